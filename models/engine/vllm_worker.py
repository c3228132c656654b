"""The vLLM worker of the generate stage (``generate.engine: vllm``): a plain script run by the interpreter of vLLM's
own environment (``generate.vllm_python``), never imported by the pipeline.

vLLM cannot be installed beside the pipeline (its releases cap transformers, fastapi and numpy below the
pipeline's pins: ../shared/NOTES.md), so it lives in its own venv and its own process. This file therefore imports
only the standard library and ``vllm``; everything project-specific (tokenising, seeds, the samples schema) stays in
:mod:`models.engine.vllm_sampling`, which starts this script once per stage and speaks to it in JSON lines.

The wire format, one JSON object per line (calls follow vLLM 0.33's ``vllm/entrypoints/llm.py``):

* stdin, first line: ``{"op": "load", "llm": {...}}`` → ``vllm.LLM(**llm)`` (model folder, dtype, seed,
  tensor_parallel_size, trust_remote_code); answered ``{"ready": true, "vllm_version": "..."}``.
* stdin, then: ``{"op": "generate", "prompts": [[ids], ...], "params": [{...}, ...]}`` → ``LLM.generate(
  [{"prompt_token_ids": ids}, ...], [vllm.SamplingParams(**p), ...], use_tqdm=False)`` (one ``SamplingParams`` per
  prompt; vLLM returns the ``RequestOutput`` s in the prompts' order); answered ``{"outputs": [[{"index", "text",
  "token_ids", "finish_reason"}, ...], ...]}``, one list of ``CompletionOutput`` fields per prompt.
* stdin closed (or SIGTERM): the worker exits, and vLLM's own finalizers stop its engine processes.

Any error is a traceback on stderr and a non-zero exit: the pipeline reports the tail of stderr. vLLM logs to stdout
by default (``VLLM_LOGGING_STREAM``), and its engine processes inherit file descriptor 1, so the answers go out on a
private copy of stdout and descriptor 1 itself is pointed at stderr before vLLM is imported.
"""

import json
import os
import signal
import sys


def main() -> int:
    # python puts this script's folder first on sys.path; the pipeline's modules there (config.py, policy.py…) must
    # not shadow anything vLLM imports
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything printed, here or in a child process, is a log line
    # SIGTERM (the pipeline giving up on a busy worker) exits through the interpreter's exit, where vLLM's finalizers
    # stop its engine processes, instead of dying at once
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    import vllm

    def answer(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    llm = None
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "load":
            llm = vllm.LLM(**request["llm"])
            answer({"ready": True, "vllm_version": vllm.__version__})
        elif request["op"] == "generate":
            prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
            params = [vllm.SamplingParams(**p) for p in request["params"]]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            answer({"outputs": [[{"index": o.index, "text": o.text, "token_ids": [int(t) for t in o.token_ids],
                                  "finish_reason": o.finish_reason} for o in request_output.outputs]
                                for request_output in outputs]})
        else:
            raise ValueError(f"unknown op {request['op']!r}: expected 'load' or 'generate'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
