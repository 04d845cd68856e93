"""Tracing speed and memory: Llama-3.1-405B at seq 8192, a few other presets, and
Hugging Face Llama-3.1-8B and -405B ``config.json`` files (traced whole by ``torch.export``).

Each model is traced in a fresh Python process, so the peak RSS (``ru_maxrss``) is
that model's alone; times exclude the interpreter start but include importing torch
and the planner (and transformers for the Hugging Face config), building the model on
meta and tracing it.

    python benchmarks/bench_trace.py            # all cases
    python benchmarks/bench_trace.py --one llama3.1-405b 8192   # one case, JSON line
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = (
    ("llama3.1-405b", 8192),
    ("llama3-70b", 8192),
    ("llama3-8b", 8192),
    ("gpt3-175b", 2048),
    ("gpt2", 1024),
    ("hf-llama3.1-8b", 8192),
    ("hf-llama3.1-405b", 8192),
)
# Hugging Face configs, written to a temporary directory (meta-llama/Llama-3.1-8B's, -405B's)
_LLAMA31 = {
    "model_type": "llama", "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
}  # fmt: skip
HF_CONFIGS = {
    "hf-llama3.1-8b": {**_LLAMA31, "hidden_size": 4096, "intermediate_size": 14336,
                       "num_hidden_layers": 32, "num_attention_heads": 32},
    "hf-llama3.1-405b": {**_LLAMA31, "hidden_size": 16384, "intermediate_size": 53248,
                         "num_hidden_layers": 126, "num_attention_heads": 128},
}  # fmt: skip
# seconds, MiB: the targets, for the preset and for the Hugging Face config
LIMITS = {"llama3.1-405b": (30.0, 2048.0), "hf-llama3.1-405b": (30.0, 2048.0)}


def measure(name: str, seq_len: int) -> dict[str, float | str | int]:
    """Trace ``name`` in this process and report times (s) and peak RSS (MiB)."""
    start = time.perf_counter()
    from planner.models import resolve_model
    from planner.tracing import trace

    if name in HF_CONFIGS:
        from planner.hf import resolve_hf_config
    imported = time.perf_counter()
    if name in HF_CONFIGS:
        with tempfile.TemporaryDirectory() as directory:
            (Path(directory) / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
            handle = resolve_hf_config(directory)
    else:
        handle = resolve_model(name, seq_len=seq_len)
    built = time.perf_counter()
    graph = trace(handle, seq_len=seq_len)
    done = time.perf_counter()
    return {
        "model": name, "seq": seq_len, "tracer": graph.tracer,
        "import_s": imported - start, "build_s": built - imported, "trace_s": done - built,
        "total_s": done - start, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "segments": len(graph.segments), "types": len(graph.types),
        "tflops_fwd": graph.flops_fwd / 1e12,
    }  # fmt: skip


def run_fresh(name: str, seq_len: int) -> dict[str, float | str | int]:
    command = [sys.executable, __file__, "--one", name, str(seq_len)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "SEQ"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]))))
        return
    print(f"{'model':<18}{'seq':>6}{'tracer':>7}{'import s':>10}{'build s':>9}{'trace s':>9}"
          f"{'total s':>9}{'RSS MiB':>9}{'types':>7}{'segs':>6}{'fwd TFLOP':>11}")  # fmt: skip
    for name, seq in CASES:
        row = run_fresh(name, seq)
        print(
            f"{row['model']:<18}{row['seq']:>6}{row['tracer']:>7}{row['import_s']:>10.2f}"
            f"{row['build_s']:>9.2f}{row['trace_s']:>9.2f}{row['total_s']:>9.2f}"
            f"{row['rss_mib']:>9.0f}{row['types']:>7}{row['segments']:>6}{row['tflops_fwd']:>11.1f}"
        )
        if name in LIMITS:
            max_s, max_mib = LIMITS[name]
            ok = row["total_s"] < max_s and row["rss_mib"] < max_mib
            print(f"  target < {max_s:.0f} s and < {max_mib:.0f} MiB: {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
