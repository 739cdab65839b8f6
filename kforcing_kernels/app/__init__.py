"""The application built on the library: the reference model's K-Forcing trainer, its data, evaluation,
generation, serving and the demo. The library (``layouts``, ``ops``, ``model``, ``integrations``, ``sdpa``)
imports nothing from here.

    cli.py           the shared command-line options and defaults of every console command
    train.py         ``kforcing-train``: the trainer's command line (stage0 / stage1 / stage2 / pipeline)
    trainer.py       the training loop of one stage (DDP with torchrun)
    train_config.py  a run's settings, their checks, the run folder
    pipeline.py      Stage 0 -> 1 -> 2 -> 2 ..., reusing finished stages
    objectives.py    batches and losses: AR, forward distillation, self-forcing, noise inversion
    data.py          corpus, tokenizer, stream crops (the embedded default: this Python's stdlib)
    files.py         the atomic writer every file goes through, and the run folder's lock
    checkpoint.py    the files of a run: checkpoints, models (with their provenance), metrics
    inference.py     ``kforcing-generate``: KV-cached AR and k-token generation (Algorithm 1)
    paged_cache.py   the paged KV cache (vLLM / FlashInfer page layout) the model reads in place
    serving.py       admitting and retiring requests between decode steps over the paged cache
    evaluate.py      ``kforcing-evaluate``: per-position NLL, tokens/s, judge perplexity
    report.py        the evaluation's tables and plot
    demo.py          ``kforcing-demo``: the whole pipeline on the default corpus, then the tables
"""
