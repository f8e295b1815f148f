"""Weight versions from the trainer to the engines: every transport and format.

| module       | what it holds                                                      |
|--------------|--------------------------------------------------------------------|
| ``sync``     | the trainer's publisher and an engine's receiver: pull, disk, dist, ipc |
| ``buckets``  | a version in flat buckets, one broadcast or shared block each      |
| ``group``    | the trainer's and engines' own torch.distributed group             |
| ``config``   | where that group meets; its keyless sockets stay on loopback       |
| ``share``    | ``ipc``: buckets in shared memory (CPU) or CUDA IPC handles        |
| ``payload``  | SGLang's ``/update_weights_from_tensor`` payload, read by allow-list |
| ``loading``  | a received version into a ``TorchEngine`` (and vLLM's workers)     |
| ``lora_merge``| adapter-only versions, checked and merged onto the base weights   |

It depends on ``wire``, ``observe`` and ``errors`` only: the trainers, the engines and
the rollout actors all use it, and none of them imports another for weights.
"""
