"""Export a plain model folder (a ``none``, ``replaceme`` or ``refit`` result, or an unpruned checkpoint) of a llama or
qwen2 model as an F16 or F32 GGUF file for llama.cpp, tokenizer included.

Only plain checkpoints are exported. A ``ghost`` or ``linearpatch`` result applies an operator
``x → x(I + delta)`` to the residual stream before a kept layer: an extra matmul between two blocks that no
llama.cpp graph has, so such a folder is refused rather than written as a model that silently drops its
repair. The file follows llama.cpp's ``convert_hf_to_gguf.py`` (names from the gguf package's tensor map,
1-D tensors kept in F32, llama's Q/K rows permuted) and reloads in transformers with
``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``, the check the tests make.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from ghostlayers.errors import GhostLayersError
from ghostlayers.files.folders import MANIFEST, umask_permissions
from ghostlayers.files.reading import TOKENIZER_BYTES, read_json
from ghostlayers.model.record import PruneRecord
from ghostlayers.store.loading import check_config, loading_errors, weight_names
from ghostlayers.store.saving import from_pretrained_checked, saved_record

ARCHITECTURES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}
DTYPES = {
    "f16": (torch.float16, gguf.LlamaFileType.MOSTLY_F16),
    "f32": (torch.float32, gguf.LlamaFileType.ALL_F32),
}


def permute_rotary_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Reorder the rows of each head of a llama ``q_proj``/``k_proj`` weight (or bias) from the half-split
    rotary layout transformers uses to the interleaved pairs llama.cpp's rope expects.

    This is llama.cpp's ``LlamaModel.permute`` in ``convert_hf_to_gguf.py`` (``num_heads`` is the KV head
    count for ``k_proj``); transformers undoes it on load in ``modeling_gguf_pytorch_utils.py``
    (``LlamaTensorProcessor._reverse_permute_weights``), so the round trip is exact."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _check_source(folder: Path) -> str:
    """The folder's model type, once it is known to be a plain llama or qwen2 checkpoint whose config fits
    its weights (``loading.check_config``, as ``prune`` and ``eval`` check it)."""
    if not (folder / "config.json").exists():
        raise GhostLayersError(
            f"{folder} has no readable config.json: give a model folder (a ghostlayers output or a Hugging Face "
            "checkpoint folder)."
        )
    config = check_config(folder)
    record = saved_record(folder)
    operators = any("ghost_operator" in name for name in weight_names(folder) or [])
    if record is None and (operators or (folder / "modeling_ghostlayers.py").exists() or "auto_map" in config):
        raise GhostLayersError(
            f"{folder} carries ghostlayers' model code but no pruning record in its config.json or {MANIFEST}: "
            "the record was removed or edited, and exporting would drop its repair. Prune the source model again."
        )
    if record is not None and PruneRecord.from_dict(record, str(folder)).needs_custom_module:
        method = record.get("method", "?")
        raise GhostLayersError(
            f"{folder} was pruned with --method {method}: its repair is an operator x → x(I + delta) applied to "
            "the residual stream before a kept layer, an extra matmul that llama.cpp has no operation for (and "
            "that does not fold exactly into the neighbouring weights: every read of the stream passes through "
            "RMSNorm). Re-run ghostlayers prune with --method none, replaceme or refit (the last two fold their "
            "repair into a down-projection) to get a folder that exports."
        )
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise GhostLayersError(
            f"{folder} is a {model_type} model; GGUF export supports {' and '.join(ARCHITECTURES)} only."
        )
    return model_type


def _check_config(config: PretrainedConfig, folder: Path) -> None:
    """Refuse what the file could not state exactly: transformers' GGUF loader reads back neither rope
    scaling nor sliding windows, and llama.cpp's llama and qwen2 graphs use SiLU."""
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        raise GhostLayersError(f"{folder} uses {rope_type} rope scaling, which GGUF export does not write yet.")
    if config.hidden_act != "silu":
        raise GhostLayersError(f"{folder} uses the {config.hidden_act} activation; llama.cpp's graph uses silu.")
    windowed = set(getattr(config, "layer_types", None) or ["full_attention"]) - {"full_attention"}
    if windowed:
        raise GhostLayersError(f"{folder} has {', '.join(sorted(windowed))} layers, which GGUF export does not write.")


def _check_output(output: Path, folder: Path, overwrite: bool) -> Path:
    """Fail before any work if ``output`` may not be written: a folder, a file in the model folder, or an
    existing file without ``overwrite``."""
    output = output.expanduser()
    if output.is_dir():
        raise GhostLayersError(f"{output} is a folder: give the GGUF file's name, e.g. {output / 'model.gguf'}.")
    if folder.resolve() in output.resolve().parents:
        raise GhostLayersError(
            f"{output} is inside the model folder {folder}: write the GGUF file outside it, so the folder keeps "
            "only its own files (and stays replaceable with --overwrite)."
        )
    if output.exists() and not overwrite:
        raise GhostLayersError(f"{output} already exists. Pass --overwrite to replace it.")
    parent = next(p for p in output.absolute().parents if p.exists() or p.is_symlink())
    if not parent.is_dir():
        raise GhostLayersError(f"Cannot write {output}: {parent} is a file, not a folder. Nothing was written.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise GhostLayersError(f"Cannot write {output}: {parent} is not writable. Nothing was written.")
    return output


@torch.no_grad()
def _tensors(model: torch.nn.Module, arch: gguf.MODEL_ARCH, dtype: torch.dtype) -> dict[str, np.ndarray]:
    """The model's weights under their GGUF names: matrices in ``dtype``, 1-D tensors (norms, biases) in
    float32 as llama.cpp's converter keeps them; a tied ``lm_head`` is left out (no ``output.weight``), which
    is how readers of the file know it is tied."""
    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    heads = {gguf.MODEL_TENSOR.ATTN_Q: config.num_attention_heads, gguf.MODEL_TENSOR.ATTN_K: config.num_key_value_heads}
    tensors = {}
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        found = names.get_type_and_name(name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise GhostLayersError(f"{name} has no GGUF name in gguf's {arch.name} tensor map: it cannot be exported.")
        kind, gguf_name = found
        if arch == gguf.MODEL_ARCH.LLAMA and kind in heads:
            weight = permute_rotary_rows(weight, heads[kind])
        if not bool(torch.isfinite(weight).all()):
            raise GhostLayersError(f"{name} holds NaN or infinite values: the model is broken, nothing is exported.")
        converted = weight.to(dtype if weight.dim() > 1 else torch.float32).contiguous()
        if not bool(torch.isfinite(converted).all()):
            raise GhostLayersError(f"{name} has values beyond float16's range (±65504): export with --dtype f32.")
        tensors[gguf_name] = converted.numpy()
    return tensors


# The names llama.cpp's converter writes for the split regexes of the models it was checked on (Llama 3:
# llama-bpe, Qwen2: qwen2, …), looked up first among the names transformers' table gives the same regex.
CONVERTER_PRE_TOKENIZERS = ("llama-bpe", "qwen2", "tekken", "gpt-4o", "qwen35")


def _pre_tokenizer(spec: dict | None, folder: Path) -> str:
    """llama.cpp's name for how the tokenizer splits text before BPE (``tokenizer.ggml.pre``): plain GPT-2
    byte-level splitting, SmolLM's single digits before it, or a split regex that transformers' GGUF tokenizer
    table names (llama-bpe, qwen2, …; ``integrations/gguf/gguf_tokenizer_mapping.py``), under the name
    llama.cpp's converter gives the source model where several name the same regex. llama.cpp identifies
    pre-tokenizers by these names only, so anything else is refused rather than guessed."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    spec = spec or {}
    steps = spec.get("pretokenizers", []) if spec.get("type") == "Sequence" else [spec]
    kinds = [step.get("type") for step in steps]
    last = steps[-1] if steps else {}
    if kinds == ["ByteLevel"] and last.get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and last.get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True):
        regex = steps[0].get("pattern", {}).get("Regex")
        names = [*CONVERTER_PRE_TOKENIZERS, *GGUF_PRE_TOKENIZER_SPLITS]
        for name in names:
            if GGUF_PRE_TOKENIZER_SPLITS.get(name) == regex:
                return name
    raise GhostLayersError(
        f"The pre-tokenizer of {folder / 'tokenizer.json'} ({' + '.join(map(str, kinds))}) is not one llama.cpp "
        "knows by name (gpt-2, smollm, llama3, qwen2, …): the GGUF file could not say how to split text."
    )


def _looks_special(token: str) -> bool:
    """An added token llama.cpp's converter types as control although the tokenizer does not mark it special
    (``does_token_look_special`` in its ``conversion/base.py``): ``<|…|>``, ``<｜…｜>``, ``<pad>``, ``<mask>``,
    ``<unused…>`` and two Gemma names."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _added_specials(folder: Path) -> tuple[bool, bool]:
    """Whether the folder's tokenizer adds BOS and EOS around a text, found by encoding one with and without
    special tokens (a flag in a config file can be overridden by the tokenizer class)."""
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    plain = tokenizer("a", add_special_tokens=False).input_ids
    full = tokenizer("a").input_ids
    start = next((i for i in range(len(full)) if full[i : i + len(plain)] == plain), None)
    prefix = full[:start] if start is not None else full
    suffix = full[start + len(plain) :] if start is not None else []
    if start is None or prefix not in ([], [tokenizer.bos_token_id]) or suffix not in ([], [tokenizer.eos_token_id]):
        raise GhostLayersError(
            f"The tokenizer of {folder} turns 'a' into {full} (without special tokens {plain}); a GGUF file can "
            "only say whether one BOS and one EOS are added."
        )
    return bool(prefix), bool(suffix)


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """Write the byte-level BPE tokenizer of ``folder/tokenizer.json`` as llama.cpp's ``gpt2`` model: every id
    up to the embedding size (ids the tokenizer lacks as unused ``[PAD<id>]``), token types from its added
    tokens, merges, special ids and chat template (gguf's ``SpecialVocab``, as llama.cpp's converter), and
    whether BOS/EOS are added, measured by encoding with the folder's own tokenizer."""
    if not (folder / "tokenizer.json").exists():
        raise GhostLayersError(
            f"{folder} has no readable tokenizer.json: GGUF export needs the fast tokenizer saved with the model."
        )
    spec = read_json(folder / "tokenizer.json", "the tokenizer", TOKENIZER_BYTES)
    model = spec.get("model", {})
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or (spec.get("decoder") or {}).get("type") != "ByteLevel"
    ):
        raise GhostLayersError(
            f"{folder / 'tokenizer.json'} is not a byte-level BPE (GPT-2 style) tokenizer, the only kind GGUF "
            "export writes."
        )
    added = {token["id"]: token for token in spec.get("added_tokens", [])}
    by_id = {i: token for token, i in model["vocab"].items()} | {i: token["content"] for i, token in added.items()}
    if max(by_id) >= vocab_size:
        raise GhostLayersError(
            f"The tokenizer of {folder} has ids up to {max(by_id)}, beyond the model's {vocab_size} embeddings."
        )
    tokens, types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        if i not in by_id:
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            control = added[i].get("special") or _looks_special(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec.get("pre_tokenizer"), folder))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    add_bos, add_eos = _added_specials(folder)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    special.add_special_token |= {"bos": add_bos, "eos": add_eos}
    special.add_to_gguf(writer, quiet=True)


@contextlib.contextmanager
def _tokenizer_errors(folder: Path) -> Iterator[None]:
    """A tokenizer.json that parses as JSON but not as a tokenizer (fields missing or of the wrong type), or
    that the tokenizers library rejects, as one message."""
    try:
        yield
    except GhostLayersError:
        raise
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot read
        raise GhostLayersError(
            f"{folder / 'tokenizer.json'} is malformed ({type(error).__name__}: {' '.join(str(error).split())[:160]})"
            ": save the model's tokenizer again."
        ) from error


def _add_hyperparameters(writer: gguf.GGUFWriter, config: PretrainedConfig, name: str) -> None:
    """The keys transformers' GGUF loader (``integrations/ggml.py``, ``GGUF_CONFIG_MAPPING``) turns back into
    the config, plus the head sizes llama.cpp reads."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


class WriteError(GhostLayersError, OSError):
    """A write that failed (disk full, no permission): one line at the command line, and still the OSError
    that callers of ``export_gguf`` catch."""


def _remove_leftovers(output: Path) -> None:
    """Partial files of export runs on ``output`` that were killed (kill -9 leaves them): each is locked
    while its run writes it, so one no process holds is a leftover."""
    for leftover in output.parent.glob(f".{output.name}.*.partial"):
        try:
            fd = os.open(leftover, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                leftover.unlink()
        except OSError:
            pass  # another export is writing it
        finally:
            os.close(fd)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _atomic_file(output: Path) -> Iterator[Path]:
    """A temporary file beside ``output`` that replaces it only if the block succeeds; never a half-written
    ``output``, and nothing left behind on an error, Ctrl-C or SIGTERM (turned into an interrupt here)."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(output)
        handle, name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent)
    except OSError as error:
        raise WriteError(f"Cannot write {output}: {error.strerror or error}. Nothing was written.") from error
    fcntl.flock(handle, fcntl.LOCK_EX)
    tmp = Path(name)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if main else None
    try:
        yield tmp
        umask_permissions(tmp)
        os.replace(tmp, output)
    except OSError as error:
        raise WriteError(f"Cannot write {output}: {error.strerror or error}. Nothing was written.") from error
    finally:
        tmp.unlink(missing_ok=True)
        os.close(handle)
        if main:
            signal.signal(signal.SIGTERM, previous)


def export_gguf(model_dir: str | Path, output: str | Path, dtype: str = "f16", overwrite: bool = False) -> Path:
    """Write the plain llama/qwen2 checkpoint in ``model_dir`` to ``output`` as a GGUF file (``dtype`` f16 or
    f32 for the matrices). Every refusal comes before anything is written."""
    folder = Path(model_dir).expanduser()
    if dtype not in DTYPES:
        raise GhostLayersError(f"Unknown GGUF dtype {dtype!r}: use {' or '.join(DTYPES)}.")
    torch_dtype, file_type = DTYPES[dtype]
    arch = ARCHITECTURES[_check_source(folder)]
    output = _check_output(Path(output), folder, overwrite)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    _check_config(config, folder)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[arch])
    _add_hyperparameters(writer, config, folder.resolve().name)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    with _tokenizer_errors(folder):
        _add_tokenizer(writer, folder, config.vocab_size)
    with loading_errors(str(folder), str(folder)):
        model = from_pretrained_checked(AutoModelForCausalLM, folder, dtype="auto")
    for name, array in _tensors(model, arch, torch_dtype).items():
        writer.add_tensor(name, array)
    with _atomic_file(output) as tmp:
        try:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return output
