"""Cost at real model shapes with random weights, in bf16, measured side by side in one run.

    python benchmarks/gpu.py [--shape qwen2.5-1.5b,llama3-8b,qwen2.5-7b] [--out benchmarks/results]
    python benchmarks/gpu.py --shape tiny      # a dry run of every step on CPU, in seconds

Random weights from configs built here, because GPU machines reach no hub: time and memory do not depend
on the weights' values (quality does, and is not measured). The results go to ``<out>/gpu-<device>.json``
(``cpu``, or the CUDA device's name), rewritten after every step, so a run cut short keeps what it measured;
a later run adds its shapes to the same file. Steps, per shape:

- ``forward``: the decoder body (no LM head) over the calibration tokens: the floor;
- ``products``: one batch's Gram matrix of a middle boundary's state through ``products.product``
  against float64 (time, relative error; also unchunked, to show what the chunking buys);
- ``plan``: ``ghostlayers.plan`` with streamline selection and the default memory budget (its route kept);
- ``similarity_pass``: the selection pass alone (no pair statistics): what ``plan`` costs besides products;
- ``reference``: ``reference_pipeline``, a stand-in for the published design (teacher copy, float32 activations, lstsq);
- ``summary``: plan against forward and reference (time), and its extra peak against the reference's;
- ``fit``: ghost operators fitted from the plan and the model pruned in place;
- ``prefill``: the pruned model with its operators against the same model with each replaced by the
  identity (``operators_removed``), interleaved rounds, medians;
- ``decode``: the same two, greedy ``generate`` with a static cache, which transformers compiles on CUDA
  (inductor, default mode: reduce-overhead failed there) so that Python overhead does not hide the operator;
  per-token time from ``generate(T)`` minus ``generate(1)``.

Peak memory per step: the CUDA allocator's peak, or peak RSS on CPU, with the weights' size beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from harness import median_seconds, sync
from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig, StaticCache

import ghostlayers
from ghostlayers.calibration.passes import boundary_state, calibrate
from ghostlayers.numerics.products import TENSOR_CORE_CHUNK, product, tensor_cores

SHAPES: dict[str, dict] = {
    "tiny": dict(
        model_type="llama", num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2", num_hidden_layers=28, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, rope_theta=1e6, tie_word_embeddings=True,
    ),
    "llama3-8b": dict(
        model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, rope_theta=5e5,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, rope_theta=1e6,
    ),
}  # fmt: skip
# (layers removed, calibration samples, seq len, batch, prompt tokens, prefill batch, decode batch, new tokens)
TINY_SETTINGS = dict(remove=2, samples=8, seq_len=32, batch_size=4, prompt=16, prefill_batch=2, decode_batch=2, new=8)
SETTINGS = dict(samples=64, seq_len=2048, batch_size=8, prompt=2048, prefill_batch=8, decode_batch=8, new=64)
REMOVE = {"qwen2.5-1.5b": 7, "llama3-8b": 8, "qwen2.5-7b": 7}
STEPS = ("forward", "products", "plan", "similarity_pass", "reference", "fit", "prefill", "decode")


def memory_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last ``reset_peak``) of this process, Linux only."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024


def reset_peak() -> None:
    """Start the peak-RSS count afresh, so tokenizing the corpus before the variant does not hide it."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


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
    from ghostlayers.model.modeling_ghostlayers import GhostOperator

    hosts = [m for m in model.modules() if isinstance(getattr(m, "ghost_operator", None), GhostOperator)]
    operators = [host.ghost_operator for host in hosts]
    for host in hosts:
        host.ghost_operator = torch.nn.Identity()
    try:
        yield
    finally:
        for host, operator in zip(hosts, operators, strict=True):
            host.ghost_operator = operator


def device_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def measured(device: torch.device, fn: Callable[[], object]) -> tuple[object, dict[str, float]]:
    """Run ``fn`` once: its wall time, the peak memory while it ran, and that peak above what was held
    before (CUDA: the allocator's counters; CPU: peak RSS, counted afresh by ``reset_peak``)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        reset_peak()
        before = memory_mb("VmRSS") * 2**20
    start = time.perf_counter()
    out = fn()
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else memory_mb("VmHWM") * 2**20
    return out, {"seconds": seconds, "peak_bytes": peak, "extra_peak_bytes": peak - before}


def interleaved(device: torch.device, model, fn: Callable[[], object], rounds: int) -> dict[str, float]:
    """Median seconds of ``fn`` on the pruned model with its operators and with them replaced by the
    identity, alternating within each round (ABBA) so that drift hits both alike."""
    times: dict[str, list[float]] = {"with_operator": [], "without_operator": []}

    def once(name: str) -> None:
        sync(device)
        start = time.perf_counter()
        if name == "with_operator":
            fn()
        else:
            with operators_removed(model):
                fn()
        sync(device)
        times[name].append(time.perf_counter() - start)

    for name in times:  # warm-up (and, on CUDA, compilation) of each variant, not counted
        once(name)
        times[name].clear()
    for r in range(rounds):
        for name in list(times)[:: 1 if r % 2 == 0 else -1]:
            once(name)
    with_op, without = (statistics.median(v) for v in times.values())
    return {"with_operator_s": with_op, "without_operator_s": without, "ratio": with_op / without}


def build(shape: str, device: torch.device, dtype: torch.dtype):
    config = AutoConfig.for_model(**SHAPES[shape])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@torch.no_grad()
def run_shape(shape: str, device: torch.device, dtype: torch.dtype, args, record: Callable[..., None]) -> None:
    settings = dict(TINY_SETTINGS) if shape == "tiny" else {**SETTINGS, "remove": REMOVE[shape]}
    settings.update({k: v for k, v in vars(args).items() if k in settings and v is not None})
    model = build(shape, device, dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total, remove = model.config.num_hidden_layers, settings["remove"]
    record("model", {"config": SHAPES[shape], "settings": settings, "dtype": str(dtype), "weight_bytes": weights})
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (settings["samples"], settings["seq_len"]), generator=g).to(device)
    batches = list(tokens.split(settings["batch_size"]))
    steps = set(args.steps.split(","))

    seen: dict[str, dict[str, float]] = {}

    def step(name: str, fn: Callable[[], object]) -> object:
        out, seen[name] = measured(device, fn)
        record(name, {**seen[name], "peak_over_weights": seen[name]["peak_bytes"] / weights})
        return out

    def body_forward() -> None:  # one batch's output held at a time, as calibration holds its states
        for b in batches:
            model.base_model(input_ids=b, use_cache=False)

    model.base_model(input_ids=batches[0][:1], use_cache=False)  # warm-up: kernels, allocator
    if "forward" in steps:
        step("forward", body_forward)
    if "products" in steps:
        record("products", products_step(model, batches[0], total // 2, device))
    plan = None
    if steps & {"plan", "fit", "prefill", "decode"}:
        plan = step(
            "plan",
            lambda: ghostlayers.plan(model, batches, select="streamline", num_layers=remove, progress=False),
        )
        record("plan", {"passes": plan.passes, "route": plan.route, "removed": plan.removed}, update=True)
    if "similarity_pass" in steps:
        step("similarity_pass", lambda: calibrate(model, batches, [], band=remove, depth=total, progress=False))
    if "reference" in steps:
        step("reference", lambda: reference_pipeline(model, batches, remove))
    if {"forward", "plan", "reference"} <= set(seen):
        record("summary", summary(seen["forward"], seen["plan"], seen["reference"]))
    if plan is None:
        return
    step("fit", lambda: ghostlayers.apply_plan(model, plan, "ghost", progress=False))
    if "prefill" in steps:
        prompt = torch.randint(0, vocab, (settings["prefill_batch"], settings["prompt"]), generator=g).to(device)
        numbers = interleaved(
            device, model, lambda: model(input_ids=prompt, use_cache=False, logits_to_keep=1), args.rounds
        )
        record("prefill", {**numbers, "tokens": prompt.numel()})
    if "decode" in steps:
        record("decode", decode(model, device, settings, vocab, g, args.rounds))


def summary(forward: dict, ours: dict, reference: dict) -> dict:
    """The plan's time over a plain forward and over the reference pipeline's, and its extra peak memory."""
    return {
        "plan_over_forward": ours["seconds"] / forward["seconds"],
        "plan_over_reference": ours["seconds"] / reference["seconds"],
        "extra_peak_plan_over_reference": ours["extra_peak_bytes"] / max(reference["extra_peak_bytes"], 1),
    }


def products_step(model, batch: torch.Tensor, boundary: int, device: torch.device) -> dict:
    """The Gram product of one batch's state at ``boundary``: the route's time and error against float64."""
    state = boundary_state(model, batch, boundary).flatten(0, -2)  # tokens × C
    exact = state.double().T @ state.double()

    def error(chunk: int) -> float:
        return float((product(state, state, torch.float64, chunk) - exact).norm() / exact.norm())

    return {
        "route": "tensor cores, float32 output" if tensor_cores(state) else "float64",
        "tokens": state.shape[0],
        "float64_s": median_seconds(device, lambda: state.double().T @ state.double(), 5),
        "route_s": median_seconds(device, lambda: product(state, state, torch.float64), 5),
        "rel_error": error(TENSOR_CORE_CHUNK),
        "rel_error_unchunked": error(state.shape[0]),
    }


def decode(model, device: torch.device, settings: dict, vocab: int, g: torch.Generator, rounds: int) -> dict:
    """Per-token decode time with and without the operators: greedy ``generate`` of ``new`` tokens minus
    that of 1 token (the prefill), on one static cache reset before each call."""
    prompt = torch.randint(0, vocab, (settings["decode_batch"], settings["prompt"]), generator=g).to(device)
    new = settings["new"]
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + new)
    compiled = device.type == "cuda"
    options = {"compile_config": CompileConfig(mode="default")} if compiled else {}

    def generate(count: int) -> None:
        cache.reset()
        model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            past_key_values=cache,
            max_new_tokens=count,
            min_new_tokens=count,
            do_sample=False,
            pad_token_id=0,
            **options,
        )

    full = interleaved(device, model, lambda: generate(new), rounds)
    first = interleaved(device, model, lambda: generate(1), rounds)
    per_token = {k: (full[k] - first[k]) / (new - 1) for k in ("with_operator_s", "without_operator_s")}
    return {
        "mode": "compiled (inductor, default mode), static cache" if compiled else "eager, static cache",
        "batch": prompt.shape[0],
        "new_tokens": new,
        "with_operator_s_per_token": per_token["with_operator_s"],
        "without_operator_s_per_token": per_token["without_operator_s"],
        "ratio": per_token["with_operator_s"] / per_token["without_operator_s"],
    }


def recorder(results: dict, shape: str, path: Path) -> Callable[..., None]:
    """A function that stores one step's numbers under ``shape`` (``update``: merged into that step's) and
    rewrites the whole file, so a run cut short keeps every finished step."""
    entry = results["shapes"][shape] = {}

    def record(name: str, numbers: dict, update: bool = False) -> None:
        entry[name] = {**entry[name], **numbers} if update else numbers
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(shape, name, json.dumps(numbers), flush=True)

    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b,llama3-8b,qwen2.5-7b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", default=",".join(STEPS), help="a subset of " + ",".join(STEPS))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds for prefill and decode")
    for name in ("remove", "samples", "seq_len", "batch_size", "prompt", "new"):
        parser.add_argument("--" + name.replace("_", "-"), type=int)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    path = args.out / f"gpu-{device_slug(device)}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.update(device=device_slug(device), torch=torch.__version__, transformers=transformers.__version__)
    results.setdefault("shapes", {})
    args.out.mkdir(parents=True, exist_ok=True)
    for shape in args.shape.split(","):
        run_shape(shape, device, dtype, args, recorder(results, shape, path))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
