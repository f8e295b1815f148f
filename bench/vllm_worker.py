"""vLLM's offline engine on a workload file, for ``bench/engine.py`` (run in vLLM's venv).

    .venv-vllm/bin/python bench/vllm_worker.py WORK.json OUT.json

``WORK.json``: ``{"model": DIR, "max_running": N, "max_model_len": L, "workloads":
{NAME: [[prompt_ids, new_tokens], ...]}}``. Each workload's first 8 requests run once as
a warm-up (vLLM's first call is slow; the engine and HF get a warm-up too), then the
whole workload is timed: every request submitted together, temperature 1, the sampled token's
log-prob returned (``logprobs=0``), EOS ignored so each request makes exactly its
length. ``OUT.json``: per workload, tokens, seconds and tokens/s, and the start-up time.

vLLM is imported only here: its dependencies conflict with asyncrl's, so it lives in its
own virtualenv (``make vllm-venv``) and never in this process's parent.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(open(sys.argv[1]).read())
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"], dtype=spec.get("dtype", "float32"),
        max_model_len=spec["max_model_len"], max_num_seqs=spec["max_running"],
        enforce_eager=spec.get("eager", True), seed=0,
    )  # fmt: skip
    result: dict = {"startup_s": time.perf_counter() - t0, "workloads": {}}
    for name, work in spec["workloads"].items():
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in work]
        params = [
            SamplingParams(temperature=1.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                           logprobs=0, seed=i)
            for i, (_, n) in enumerate(work)
        ]  # fmt: skip
        llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up, as the others
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == sum(n for _, n in work), "vLLM made other lengths than asked"
        assert all(o.outputs[0].logprobs for o in outs), "vLLM returned no log-probs"
        result["workloads"][name] = {"tokens": tokens, "seconds": seconds,
                                     "tokens_per_s": tokens / seconds}  # fmt: skip
    open(sys.argv[2], "w").write(json.dumps(result, indent=2))


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is needed
    main()
