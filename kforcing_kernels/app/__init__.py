"""The application built on the library: the reference model's K-Forcing trainer, its data, evaluation,
generation, serving, the Hugging Face recipe and the demo. The library (``layouts``, ``ops``, ``model``,
``integrations``, ``sdpa``, ``parallel``) imports nothing from here. One folder per job:

    train.py             ``kforcing-train``: the trainer's command line (stage0 / stage1 / stage2 / pipeline)
    demo.py              ``kforcing-demo``: the whole pipeline on the default corpus, then the tables
    cli.py               the shared command-line options and defaults of every console command
    data.py              corpus, tokenizer, stream crops (the embedded default: this Python's stdlib)
    files.py             every file's I/O: the atomic writer, checked readers, hashes, tokenizers; the run folder's lock
    student.py           the one seam between model kinds: the Student protocol, ModelKind, the registry of kinds
    native.py            the package's own model (KForcingLM) as a kind

    training/            one stage, and the pipeline of stages
        config.py            a run's settings, their checks, the run folder
        parallel.py          ParallelDims (one dp x cp device mesh), parallelize (AC, compile, FSDP2/DDP), the teacher's
        placement stage.py             a stage's set-up: models built and placed, optimizer, checkpointer, resume checks
        loop.py              train(): the steps of one stage and its finish
        objectives.py        batches and losses: AR, forward distillation, self-forcing, noise inversion
        targets.py           the teachers' targets (Algorithms 2, 3) and noise inversion's, chunked decoding
        context_parallel.py  the loss of a rank's share of a sequence (--context-parallel)
        checkpointer.py      the checkpoint format chosen once from the mesh; the stage's export
        checkpoint.py        whole-model checkpoints, model files (with their provenance), metrics
        sharded_checkpoint.py  DCP checkpoints of sharded runs, and their export
        pipeline.py          Stage 0 -> 1 -> 2 -> 2 ..., reusing finished stages (one process or torchrun)
    generation/          ``kforcing-generate`` and serving
        inference.py         KV-cached AR and k-token generation (Algorithm 1)
        paged_cache.py       the paged KV cache (vLLM / FlashInfer page layout) the model reads in place
        serving.py           admitting and retiring requests between decode steps over the paged cache
        checks.py            shared checks of generation requests
    evaluation/          ``kforcing-evaluate``
        evaluate.py          per-position NLL, tokens/s, judge perplexity
        run_folders.py       a run's folders as it reads them: the AR teacher, the recorded text, the judge
        report.py            the evaluation's tables and plot
        noise_diagnosis.py   how a Stage-1 student uses its noise
    hf_recipe/           K-Forcing a Hugging Face causal LM
        student.py           HFStudent: an HF model + noise embedding as the trainer's model (a Student)
        kind.py              Hugging Face models as a kind of the registry (app/student.py)
        files.py             HF sources and stage folders (save_pretrained + the noise embedding), their corpus
        trainer.py           the transformers.Trainer route: loss/targets helpers, KForcingTrainer, save/load
"""
