"""Training backends: the torch trainer and megatron-core (weight publishing is ``weights/``).

| module              | what it holds                                                 |
|---------------------|---------------------------------------------------------------|
| ``base``            | the ``Trainer`` protocol and its records                      |
| ``config``          | ``TrainerConfig``: backend, model, optimizer, parallel layout |
| ``backends``        | ``create_trainer``: the backend a config names, on its ranks  |
| ``ranks``           | a trainer over N processes: rank 0 broadcasts each call       |
| ``torch_trainer``   | Hugging Face models, AdamW, packed micro-batches, DDP/FSDP    |
| ``megatron_trainer``| megatron-core GPTModel, TP/PP/DP, distributed optimizer       |
| ``sim_trainer``     | no model: each step takes modelled time (cluster simulator)   |
| ``megatron_bridge`` | HF Qwen2/Llama <-> megatron weights, TP shards, PP stages     |
| ``vocab_parallel``  | a TP rank's vocab slice; the SFT loss from sharded logits     |
| ``token_stats``     | log-probs and entropy at a sample's temperature, chunked      |
| ``packed_attention``| sdpa per packed sequence, no ``L x L`` mask (the default)     |
| ``rl_columns``      | what both RL steps share: columns, advantages, metric tally   |
| ``rng``             | seeding and RNG state for bit-exact resumes                   |
| ``learner``         | one trained model: DP wrapper, AdamW, LR schedule, HF weights |
| ``packing``         | token-budget micro-batches and sequence packing               |
| ``parallel``        | DDP / FSDP2 wrapping, gradient sync, full state dicts         |
| ``rollout_tensors`` | a ``TrainBatch`` (or SFT examples) as ``[B, T]`` tensors      |
| ``sft``             | ``asyncrl sft``: data, batches, the supervised loop           |
"""
