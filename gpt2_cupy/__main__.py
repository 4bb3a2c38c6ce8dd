"""Command line: python -m gpt2_cupy "Hello, I'm a language model," --max-new-tokens 512"""

from __future__ import annotations

import argparse
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpt2_cupy", description="Generate text with GPT-2 on the GPU.")
    p.add_argument("prompt", nargs="?", default="Hello, I'm a language model,")
    p.add_argument("--model", default="gpt2", help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2 or a local directory")
    p.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop where this text appears (repeatable)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token")
    p.add_argument("--no-cuda-graph", action="store_true", help="launch the decode step kernel by kernel, not as a CUDA graph")
    p.add_argument("--kv-cache-dtype", default=None, choices=["int8", "fp8"],
                   help="quantize the KV cache (one scale per cached row); default: the model's dtype")
    p.add_argument("--random-weights", action="store_true",
                   help="a randomly initialized model of the chosen size (no download needed)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        from .generation import _text_steps, _tokenizer_for, load_model

        model = load_model(args.model, args.dtype, args.random_weights)
        tok = _tokenizer_for(args.model, None)
        options = dict(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, use_cache=not args.no_cache, cuda_graph=not args.no_cuda_graph,
                       kv_cache_dtype=args.kv_cache_dtype)
        steps = _text_steps(model, tok, [args.prompt], args.max_new_tokens, args.stop, "default", **options)
        # compile the kernels (first use in this process) outside the timed run
        for _ in _text_steps(model, tok, [args.prompt], 2, None, "default", **options):
            pass
        print(args.prompt, end="", flush=True)
        start = time.perf_counter()
        n = 0
        for pieces in steps:
            n += 1
            print(pieces[0], end="", flush=True)
        seconds = time.perf_counter() - start
        print()
        print(f"[{n} tokens in {seconds:.2f} s: {n / seconds:.1f} tokens/s, {args.model} {args.dtype}"
              f"{' random weights' if args.random_weights else ''}]", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # one readable line, not a traceback
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
