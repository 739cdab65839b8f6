"""What more than one op shares (fla's ``ops/common``); a piece that serves one op stays in that op's folder.

registry.py     BackendSpec / OpRegistry: each op's backends declared as data, loaded lazily, absent with a reason
validation.py   argument checks every op words the same way (check_scale, check_tensor, ATTENTION_DTYPES)
dtypes.py       acc_dtype: the accumulation / LSE dtype of an input dtype
torch_compat.py the private torch APIs the ops call (mode / transform checks, the raw CUDA stream), each behind a
                named function with a conservative fallback where a torch lacks it
triton_env.py   whether the Triton backends can run here (CUDA, or the interpreter under TRITON_INTERPRET=1)
"""
