"""Training: one stage (config, set-up, loop, objectives), where ranks sit and how models are spread over them,
checkpoints, and the pipeline of stages."""
