#!/usr/bin/env python3
"""llama.cpp's speed on this machine, for side-by-side runs with `pipeshard bench decode`.

Kept out of the build and the tests: it needs llama-cpp-python, built from its sdist
(`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python`). It measures what
`pipeshard bench decode` measures, on the same model file and thread count: prefill of a
code-like prompt of --prompt-tokens tokens, greedy decoding of --gen-tokens tokens (one token
per step), and a --verify-rows step (one sequence, logits at every row) against a one-row
step. Medians of --runs; one JSON object on stdout.

    python3 scripts/llama_cpp_bench.py --model MODEL.gguf --threads 1
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np
from llama_cpp import Llama

TEXT = 'fn main() { let v: Vec<u32> = (0..100).map(|x| x * x).collect(); println!("{:?}", v); } '


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--verify-rows", type=int, default=5)
    a = ap.parse_args()

    llm = Llama(model_path=a.model, n_ctx=1024, n_threads=a.threads, n_threads_batch=a.threads,
                n_batch=512, logits_all=False, verbose=False)
    vocab = llm.n_vocab()

    def last_argmax():
        # Only the last row's logits exist when logits_all is off (as in pipeshard's prefill
        # and decode, which compute the last row's logits only).
        row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))
        return int(row.argmax())

    prompt = llm.tokenize(TEXT.encode() * (a.prompt_tokens // 8 + 1), add_bos=False)[: a.prompt_tokens]
    pre, dec, one, many = [], [], [], []
    for _ in range(a.runs):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        pre.append(len(prompt) / (time.perf_counter() - t))
        tok = last_argmax()
        t = time.perf_counter()
        for _ in range(a.gen_tokens):
            llm.eval([tok])
            tok = last_argmax()
        dec.append(a.gen_tokens / (time.perf_counter() - t))
        # Verification: logits at every row; rewrite the same positions after the prompt.
        llm._logits_all = True
        for _ in range(4):
            for n, times in ((1, one), (a.verify_rows, many)):
                llm.n_tokens = len(prompt)
                llm._ctx.kv_cache_seq_rm(-1, len(prompt), -1)
                t = time.perf_counter()
                llm.eval(prompt[:n])
                times.append(time.perf_counter() - t)
        llm._logits_all = False
    out = {
        "engine": "llama.cpp",
        "prefill_tok_s": statistics.median(pre),
        "decode_tok_s": statistics.median(dec),
        "threads": a.threads,
        "verify_rows": a.verify_rows,
        "step_1_ms": statistics.median(one) * 1e3,
        "step_verify_ms": statistics.median(many) * 1e3,
        "verify_ratio": statistics.median(many) / statistics.median(one),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
