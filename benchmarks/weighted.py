"""Does weighting calibration tokens by the loss's sensitivity to the boundary state help ghost? (issue #14, 3b)

    python benchmarks/weighted.py [--model smollm2-135m] [--layers 13:19] [--samples 16]

The ghost fit minimises ``Σ_t ‖x_t W − y_t‖²``, dominated by the attention-sink token (norm ~170× the
median). What the pruned model's loss feels is ``g_tᵀ (x_t W − y_t)`` to first order, ``g_t`` the gradient
of the loss with respect to the next kept layer's input. A per-token weight ``w_t`` changes the solution
(a right-hand weighting would not): ``M = (Xᵀ D X + λI)⁻¹ Xᵀ D (Y − X)``, ``D = diag(w)``. The gradients
come from one backward pass of the plain-pruned model over the calibration windows. Weights tried:
``‖g_t‖²`` (isotropic Fisher per token), ``‖g_t‖``, and ``‖g_t‖² ‖x_t‖²/mean`` … against unweighted ghost,
each scored by perplexity on the held-out parts of wiki, web, code and austen, with the share of the
none→dense gap recovered. Writes ``benchmarks/results/weighted-<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from cells import machine, model_arguments, ppl_share_cells, ppl_share_header, shares

from ghostlayers.adapters import decoder_layers
from ghostlayers.calibration import boundary_state
from ghostlayers.data import calibration_set, tokenize
from ghostlayers.evaluation import perplexity_windows
from ghostlayers.loading import load_model_and_tokenizer
from ghostlayers.perplexity import perplexity
from ghostlayers.selection import parse_layers
from ghostlayers.sources.corpora import OFFLINE, calibration_sources, load_text
from ghostlayers.surgery import patched_view


def boundary_gradients(model, batches, pre: int, post: int) -> torch.Tensor:
    """``∂ loss / ∂ h`` at the input of original layer ``post`` in the model with ``pre..post-1`` removed
    (plain pruning), one row per calibration token."""
    eye = torch.eye(model.config.hidden_size, dtype=torch.float64)
    grads = []
    model.requires_grad_(False)  # only the boundary state's gradient is needed
    with patched_view(model, {(pre, post): eye}, "ghost"):
        host = decoder_layers(model)[pre]
        for batch in batches:
            captured = []

            def grab(module, args, kwargs, captured=captured):
                hidden = (args[0] if args else kwargs["hidden_states"]).detach().requires_grad_(True)
                captured.append(hidden)
                if args:
                    return (hidden, *args[1:]), kwargs
                kwargs["hidden_states"] = hidden
                return args, kwargs

            handle = host.register_forward_pre_hook(grab, with_kwargs=True, prepend=True)
            try:
                out = model(input_ids=batch, labels=batch, use_cache=False)
                out.loss.backward()
            finally:
                handle.remove()
            grads.append(captured[0].grad.reshape(-1, captured[0].shape[-1]).double())
    return torch.cat(grads)


def weighted_ghost(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """``I + M``, ``M = (Xᵀ D X + λI)⁻¹ Xᵀ D (Y − X)``, λ relative to ``tr(XᵀDX)/C``."""
    xd = x * w[:, None]
    gram = xd.T @ x
    lam = ridge * gram.diagonal().mean()
    m = torch.linalg.solve(gram + lam * torch.eye(x.shape[1], dtype=x.dtype), xd.T @ (y - x))
    return torch.eye(x.shape[1], dtype=x.dtype) + m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--layers", default="13:19")
    parser.add_argument("--calibration", default="wiki")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()
    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    removed = parse_layers(args.layers, model.config.num_hidden_layers)
    pre, post = removed[0], removed[-1] + 1
    texts = {c: tokenize(tokenizer, load_text(c, "train")) for c in calibration_sources(args.calibration)}
    batches = calibration_set(texts, args.samples, args.seq_len).batches(4)
    test = perplexity_windows(tokenizer, list(OFFLINE), args.seq_len, args.ppl_windows)
    with torch.no_grad():
        x = torch.cat([boundary_state(model, b, pre).reshape(-1, model.config.hidden_size) for b in batches]).double()
        y = torch.cat([boundary_state(model, b, post).reshape(-1, model.config.hidden_size) for b in batches]).double()
    g = boundary_gradients(model, batches, pre, post)
    g2, x2 = (g * g).sum(1), (x * x).sum(1)
    weights = {
        "ghost (unweighted)": torch.ones_like(g2),
        "‖g‖²": g2 / g2.mean(),
        "‖g‖": g2.sqrt() / g2.sqrt().mean(),
        "‖g‖² ‖x‖²": g2 * x2 / (g2 * x2).mean(),
        "‖g‖² / ‖x‖² (relative error)": (g2 / x2) / (g2 / x2).mean(),
    }

    def ppl(operators: dict | None) -> dict[str, float]:
        with torch.no_grad():
            if operators is None:
                return {c: perplexity(model, w, 4, progress=False) for c, w in test.items()}
            with patched_view(model, operators, "ghost"):
                return {c: perplexity(model, w, 4, progress=False) for c, w in test.items()}

    eye = torch.eye(model.config.hidden_size, dtype=torch.float64)
    rows = {"dense": ppl(None), "none": ppl({(pre, post): eye})}
    for name, w in weights.items():
        op = weighted_ghost(x, y, w)
        rows[name] = ppl({(pre, post): op})
        residual = ((x @ op - y).norm() / (y - x).norm()).item()
        rows[name]["fit residual"] = residual
        rows[name]["share"] = shares({c: rows[name][c] for c in OFFLINE}, rows["none"], rows["dense"])
        print(name, rows[name], flush=True)
    sink = int(x2.argmax())
    result = {
        "model": args.model,
        "settings": {**vars(args), "removed": removed, "tokens": x.shape[0]},
        "machine": machine(),
        "weight of the largest-norm token (‖g‖², mean 1)": float(weights["‖g‖²"][sink]),
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }
    path = Path(args.json or f"benchmarks/results/weighted-{args.model}.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    header = f"| fit | {ppl_share_header(list(OFFLINE))} | fit residual |"
    print(f"\n{args.model}, removed {removed}, {x.shape[0]} calibration tokens from {args.calibration}\n")
    print(header + "\n" + "|---" * (2 + 2 * len(OFFLINE)) + "|")
    for name, r in rows.items():
        gap = (rows["none"], rows["dense"]) if "share" in r else (None, None)
        print(f"| {name} | {ppl_share_cells(r, list(OFFLINE), *gap)} | {r.get('fit residual', float('nan')):.3f} |")


if __name__ == "__main__":
    main()
