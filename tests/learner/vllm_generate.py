"""Greedy generation with vLLM under LoRA adapter directories; prints one JSON line per adapter. Run as a script
(vLLM spawns processes).

    python tests/learner/vllm_generate.py MODEL_DIR '[[1, 20, 30], ...]' ADAPTER_DIR [ADAPTER_DIR ...]
        ->  one ``RESULT [{"tokens", "logprobs"}, ...]`` line per adapter directory, in order

One engine serves every directory, each under its own int LoRA id (a reused id would serve the first one's
weights: the stale-cache trap in FACTS.md).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model_dir, prompts, adapter_dirs = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model_dir, tokenizer=model_dir, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=1,
              max_model_len=128, max_num_seqs=4, enforce_eager=True, logprobs_mode="raw_logprobs")
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    for lora_id, adapter_dir in enumerate(adapter_dirs, start=1):
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               lora_request=LoRARequest(f"learner-adapter-{lora_id}", lora_id, adapter_dir))
        result = []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            result.append({"tokens": tokens,
                           "logprobs": [step[t].logprob for step, t in zip(completion.logprobs, tokens, strict=True)]})
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
