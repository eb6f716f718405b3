"""Cost of calibration and of the inserted operators, measured side by side in one run.

    python benchmarks/cost.py [--model smollm2-135m] [--quick] [--versions before=../old-checkout]

Each calibration variant runs in its own subprocess on the same model and tokens, so its peak RSS is its
own. Variants:
- ``forward``: one plain forward pass over the calibration tokens (the floor);
- ``ghostlayers``: our pipeline, streamline selection + statistics + solve (one pass);
- ``two-pass``: the same with ``--stats-memory 0``: a selection pass holding no candidate statistics,
  then a pass truncated at the chosen block's end for its statistics (less memory, more time);
- ``offload``: the same with ``offload``: the model is never loaded whole, layers are read from the files
  one at a time (its extra peak includes the pruned model it ends with, read after calibration);
- ``refit``: ``--method refit``: a selection pass, then a truncated pass gathering the last kept layer's
  ``I × I`` down-projection sums for the chosen block;
- ``select-loss``: ``--select loss``: candidates from one pass, each repaired and scored on two windows
  (here two calibration windows stand in for the held-out ones: the cost is the same);
- ``reference``: the published code's design: a forward pass with all hidden states for selection, a deep
  copy of the model as teacher, the two boundaries' activations materialized in float32 and concatenated,
  then a least-squares solve.
With ``--versions label=checkout,...`` every variant also runs on those checkouts' ``src`` (each in its own
subprocess, interleaved with the current code's), for before/after tables measured in one run; a variant an
older checkout lacks is left out. Then prefill/decode of dense vs pruned (no operator) vs pruned + ghost
operator. Peak RSS is counted from a reset taken once the weights are resident (a warm-up forward of 8 tokens
faults the memory-mapped weights in), so "extra peak" is what the variant itself allocates.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from ghostlayers.data import batched, calibration_windows, tokenize


def memory_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last ``reset_peak``) of this process, Linux only."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024


def reset_peak() -> None:
    """Start the peak-RSS count afresh, so tokenizing the corpus before the variant does not hide it."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def setup(args, offload: bool = False):
    """The model (for ``offload``, its weightless skeleton and ``Checkpoint``) and the calibration batches."""
    from ghostlayers.loading import load_for_offload, load_model_and_tokenizer
    from ghostlayers.sources.corpora import load_text

    if offload:
        checkpoint, tokenizer = load_for_offload(args.model, device="cpu")
        model = (checkpoint.skeleton(), checkpoint)
    else:
        model, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    tokens = tokenize(tokenizer, load_text("wiki", "train"))
    batches = batched(calibration_windows(tokens, args.samples, args.seq_len, 0), args.batch_size)
    return model, batches


@torch.no_grad()
def run_variant(args) -> dict:
    model, batches = setup(args, offload=args.variant == "offload")
    if args.variant != "offload":  # fault the memory-mapped weights in (≈ 400 MB here): not the variant's cost
        model(input_ids=batches[0][:1, :8], use_cache=False)
    reset_peak()
    base = memory_mb("VmRSS")
    start = time.perf_counter()
    if args.variant == "offload":  # ends holding the pruned model, read after calibration
        import ghostlayers

        skeleton, checkpoint = model
        model = ghostlayers.prune(
            skeleton, batches, select="streamline", num_layers=args.remove, offload=checkpoint, progress=False
        ).model
    elif args.variant == "forward":
        for b in batches:
            model(input_ids=b, use_cache=False)
    elif args.variant in ("ghostlayers", "two-pass", "refit"):
        import ghostlayers

        options = {"memory_budget": 0} if args.variant == "two-pass" else {}
        options |= {"method": "refit"} if args.variant == "refit" else {}  # selection pass, then its I×I pass
        ghostlayers.prune(model, batches, select="streamline", num_layers=args.remove, progress=False, **options)
    elif args.variant == "select-loss":
        import ghostlayers

        heldout = {"wiki": torch.cat(batches[:1])[:2]}  # two windows of the calibration text: its held-out part
        ghostlayers.prune(model, batches, select="loss", num_layers=args.remove, heldout=heldout, progress=False)
    else:
        reference_pipeline(model, batches, args.remove)
    seconds = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {"seconds": seconds, "extra_peak_mb": memory_mb("VmHWM") - base, "model_mb": weights}


@torch.no_grad()
def reference_pipeline(model, batches, n: int) -> torch.Tensor:
    """Selection from a full ``output_hidden_states`` pass, then a teacher copy whose boundary activations
    are stored, concatenated and solved — the layout of the public ReplaceMe / LinearPatch scripts."""
    distances = None
    for b in batches:
        hs = model(input_ids=b, output_hidden_states=True, use_cache=False).hidden_states
        d = torch.stack(
            [1 - torch.nn.functional.cosine_similarity(hs[i], hs[i + n], dim=-1).mean() for i in range(len(hs) - n - 1)]
        )
        distances = d if distances is None else distances + d
    start = int(distances.argmin())
    teacher = copy.deepcopy(model)
    xs, ys = [], []
    for b in batches:
        hs = teacher(input_ids=b, output_hidden_states=True, use_cache=False).hidden_states
        xs.append(hs[start].reshape(-1, hs[start].shape[-1]).float())
        ys.append(hs[start + n].reshape(-1, hs[start].shape[-1]).float())
    x, y = torch.cat(xs), torch.cat(ys)
    return torch.linalg.lstsq(x, y - x).solution


@contextlib.contextmanager
def operators_removed(model):
    """The same pruned model without its operators' matmul (each replaced by the identity module)."""
    from ghostlayers.modeling_ghostlayers import GhostOperator

    hosts = [m for m in model.modules() if isinstance(getattr(m, "ghost_operator", None), GhostOperator)]
    operators = [host.ghost_operator for host in hosts]
    for host in hosts:
        host.ghost_operator = torch.nn.Identity()
    try:
        yield
    finally:
        for host, operator in zip(hosts, operators, strict=True):
            host.ghost_operator = operator


def inference_rows(args) -> list[tuple[str, dict]]:
    """Dense, pruned + ghost, and the same pruned model with its operators removed, measured in
    interleaved rounds (one prefill + decode each), so drift on a noisy machine hits all three alike."""
    import statistics

    import ghostlayers
    from ghostlayers.speed import measure_speed

    dense, batches = setup(args)
    pruned, _ = setup(args)
    ghostlayers.prune(pruned, batches, select="streamline", num_layers=args.remove, progress=False)
    rounds: dict[str, list[dict]] = {"dense": [], "pruned, no operator": [], "pruned + ghost operator": []}
    for _ in range(args.repeats):
        rounds["dense"].append(measure_speed(dense, prompt_len=args.prompt, repeats=1))
        with operators_removed(pruned):
            rounds["pruned, no operator"].append(measure_speed(pruned, prompt_len=args.prompt, repeats=1))
        rounds["pruned + ghost operator"].append(measure_speed(pruned, prompt_len=args.prompt, repeats=1))
    return [(name, {key: statistics.median(r[key] for r in runs) for key in runs[0]}) for name, runs in rounds.items()]


def inference_table(args) -> dict[str, dict]:
    """``inference_rows`` printed as a table, each with its prefill time relative to the pruned model
    without operators."""
    rows = inference_rows(args)
    pruned_none = dict(rows)["pruned, no operator"]
    print(f"inference, prompt {args.prompt} tokens, 32 decode steps, median of {args.repeats}\n")
    print("| model | prefill ms | decode tok/s | prefill × pruned-none | parameters |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['prefill_ms']:.1f} | {r['decode_tokens_per_s']:.1f} | "
            f"{r['prefill_ms'] / pruned_none['prefill_ms']:.3f} | {int(r['parameters']):,} |"
        )
    return {name: {**r, "x_pruned_none": r["prefill_ms"] / pruned_none["prefill_ms"]} for name, r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--remove", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="8 samples, 3 repeats (a few minutes)")
    parser.add_argument("--json", help="default: benchmarks/results/cost-<model>.json")
    parser.add_argument("--versions", default="", help="label=checkout,...: also run on older code, side by side")
    parser.add_argument("--variants", default="forward,ghostlayers,two-pass,offload,select-loss,reference")
    parser.add_argument("--no-inference", action="store_true", help="skip the dense/pruned inference rows")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.samples, args.repeats = 8, 3
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    torch.set_num_threads(torch.get_num_threads())
    common = [
        f"--model={args.model}",
        f"--samples={args.samples}",
        f"--seq-len={args.seq_len}",
        f"--batch-size={args.batch_size}",
        f"--remove={args.remove}",
    ]
    versions = {"current": None, **dict(v.split("=", 1) for v in args.versions.split(",") if v)}
    results: dict[str, dict] = {label: {} for label in versions}
    for variant in args.variants.split(","):
        for label, checkout in versions.items():
            env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve() / "src")} if checkout else None
            out = subprocess.run(
                [sys.executable, __file__, *common, f"--variant={variant}"], capture_output=True, text=True, env=env
            )
            if out.returncode == 0:
                results[label][variant] = json.loads(out.stdout.strip().splitlines()[-1])
            elif checkout is None:
                raise RuntimeError(f"{variant} failed:\n{out.stderr[-2000:]}")
    tokens = args.samples * args.seq_len
    print(f"\ncalibration on {args.model}, {tokens} tokens, removing {args.remove} layers (streamline)\n")
    print("| code | variant | seconds | × forward | × reference | extra peak RSS MB | × model size |")
    print("|---|---|---|---|---|---|---|")
    calibration = {}
    for label, runs in results.items():
        floor, ref = runs["forward"], runs.get("reference")
        calibration[label] = {
            name: {
                **r,
                "x_forward": r["seconds"] / floor["seconds"],
                **({"x_reference": r["seconds"] / ref["seconds"]} if ref else {}),
                "x_model_size": r["extra_peak_mb"] / floor["model_mb"],
            }
            for name, r in runs.items()
        }
        for name, r in calibration[label].items():
            x_ref = r.get("x_reference", float("nan"))
            print(
                f"| {label} | {name} | {r['seconds']:.1f} | {r['x_forward']:.2f} | {x_ref:.2f} | "
                f"{r['extra_peak_mb']:.0f} | {r['x_model_size']:.2f} |"
            )
    floor = results["current"]["forward"]
    print(f"\nmodel weights: {floor['model_mb']:.0f} MB\n")
    inference = {} if args.no_inference else inference_table(args)
    path = Path(args.json or f"benchmarks/results/cost-{args.model}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("variant", "json")}
    settings["machine"] = f"{platform.machine()} CPU, {torch.get_num_threads()} threads, float32"
    path.write_text(json.dumps({"settings": settings, "calibration": calibration, "inference": inference}, indent=2))


if __name__ == "__main__":
    main()
