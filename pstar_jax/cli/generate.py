"""pstar-generate: sample text from a pstar checkpoint, a Flax export or a Hugging Face directory.

Only wiring: the weights' source names the model and streams its tensors, a tokenizer turns the
prompt into ids and the ids back into text, and pstar_jax.engine.decode runs the model: with a KV cache
on the device when parameters, cache and working memory fit --device-memory, else streamed from
host memory stage by stage (slow; it says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from pstar_jax.cli import flags as cli
from pstar_jax.config import MAX_SEED, ConfigError, ModelConfig, RunConfig, format_bytes, from_dict
from pstar_jax.config.errors import DataError

PRECISIONS = ("bf16", "fp32")
notes = logging.getLogger(__name__)  # what it is doing while it loads and compiles (cli.start_up_notes)


def _device_memory(text: str) -> Any:
    from pstar_jax.config import parse_device_memory
    try:
        return parse_device_memory(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).replace("EngineConfig.device_memory", "--device-memory")) from None


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="pstar-generate", description=__doc__.splitlines()[0])
    source = p.add_argument_group("weights (one of)").add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint-dir", metavar="DIR", help="a pstar-train --checkpoint-dir (the model is "
                        "rebuilt from the run's saved configuration)")
    source.add_argument("--flax", metavar="DIR", help="a Flax export (--export-flax)")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint directory (gpt2, llama, qwen2, "
                        "mistral, qwen3)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--model-module", default=None, help="module with build_model, build_from_hf and "
                   "hf_tensors, imported (its code run) because you name it: needed for a checkpoint trained with a "
                   "module other than pstar_models (default: pstar_models)")
    p.add_argument("--tokenizer", metavar="DIR_OR_FILE", default=None, help="tokenizer.json or its directory "
                   "(default: the --hf directory, or the run's --init-from-hf directory; byte-level for a "
                   "256-token vocabulary)")
    p.add_argument("--eos-token", default=None, help="end-of-text token, where generation stops (default: "
                   "eos_token of tokenizer_config.json; NUL on the byte-level path)")
    p.add_argument("--prompt", default="", help="text to continue (default: empty, starting from end-of-text)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template with the generation "
                   "prompt to --prompt (a user message) or --messages, and stop at the end of the assistant's turn")
    p.add_argument("--messages", metavar="FILE", default=None, help="with --chat: a JSON list of "
                   "{\"role\", \"content\"} messages to answer")
    p.add_argument("--chat-template", metavar="FILE", default=None, help="with --chat: a Jinja chat template "
                   "(default: the tokenizer's own)")
    p.add_argument("--chat-template-kwargs", metavar="JSON", default=None, help="with --chat: extra template "
                   "variables, a JSON object, e.g. '{\"enable_thinking\": false}' for Qwen3")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 is greedy (default: 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: draw from the most likely tokens "
                   "holding this much probability (default: 1, all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="compute dtype of parameters and "
                   "cache (default: the run's for a checkpoint, else bf16)")
    p.add_argument("--device-memory", type=_device_memory, default=None, metavar="DEVICE_MEMORY",
                   help="device memory the decoder may use: bytes (2GiB), a fraction of the device (0.8) or "
                   "auto (0.9 of an accelerator, all of a CPU); a larger model is streamed from host memory")
    p.add_argument("--stream", action="store_true", help="stream the parameters stage by stage even if the "
                   "model fits on the device")
    p.add_argument("--quiet", action="store_true", help="no start-up lines on stderr (reading the weights, "
                   "compiling); the text, the tokens/s line, notes and errors still print")
    return p


# -- where the weights come from --------------------------------------------------------------


@dataclasses.dataclass
class Source:
    model: Any  # an NNXStaged whose module implements pstar_jax.engine.decode.Decoder
    tensors: Callable[[], Iterator[tuple[str, np.ndarray]]]  # name -> fp32 tensor, one at a time
    tokenizer_dir: str | None  # where a tokenizer may be found when none is given
    precision: str
    close: Callable[[], None] = lambda: None


def _same_shapes(model: Any, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    if shapes != {n: tuple(s) for n, s in model.param_shapes().items()}:
        from pstar_jax.io.checkpoint import CheckpointError
        raise CheckpointError(f"the model rebuilt from the run's configuration does not match the checkpoint in "
                              f"{where}; pass the --model-module it was trained with")


def checkpoint_source(directory: str, step: int | None, module: str | None) -> Source:
    if not os.path.isdir(directory):  # Checkpointer would create it
        raise ConfigError(f"--checkpoint-dir {directory} is not a directory")
    from pstar_jax.io.base_record import checkpoint_tensors
    from pstar_jax.io.checkpoint import Checkpointer, CheckpointError
    from pstar_jax.engine.chunks import ChunkLayout
    from pstar_jax.io.models import load_model, saved_run_config
    notes.info("reading the checkpoint in %s and building its run's model", directory)
    ckpt = Checkpointer(directory)
    try:
        meta = ckpt.meta(step)
        if not isinstance(meta.get("config"), dict):
            raise CheckpointError(f"checkpoint in {ckpt.directory} does not record its run's configuration; it "
                                  "was not written by this version of pstar-train")
        config = from_dict(RunConfig, meta["config"])
        config = saved_run_config(config, module, ckpt.directory, "pstar-generate")
        model = load_model(config)
        _same_shapes(model, {s.name: s.shape for s in ChunkLayout.from_json(meta["layout"]).slots}, ckpt.directory)
        # A LoRA run's checkpoint holds the adapters (and modules_to_save): the base comes from its record.
        tensors = finite(checkpoint_tensors(ckpt, meta, model, config), ckpt.directory)
    except BaseException:
        ckpt.close()
        raise
    return Source(model, lambda: tensors, config.model.init_from_hf, config.engine.precision, ckpt.close)


def finite(tensors: Iterator[tuple[str, np.ndarray]], where: str) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors, refusing one with a NaN or inf: such a model samples garbage without a word."""
    from pstar_jax.io.checkpoint import CheckpointError
    for name, value in tensors:
        if not np.isfinite(value).all():
            raise CheckpointError(f"parameter {name} in {where} holds NaN or infinite values; generate from an "
                                  "earlier checkpoint (--step)")
        yield name, value


def hf_source(directory: str, module: str | None) -> Source:
    from pstar_jax.io.hf import HFCheckpoint
    from pstar_jax.io.models import hf_functions, load_model
    config = RunConfig(model=ModelConfig(module=module or "pstar_models", init_from_hf=directory))
    notes.info("building the model of %s", directory)
    model = load_model(config)
    try:
        tensor_map = hf_functions(config)[0](model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    weights = HFCheckpoint(directory, tensor_map, model.param_shapes())
    return Source(model, lambda: ((n, weights[n]) for n in weights), directory, "bf16", weights.close)


def flax_model(directory: str) -> Any:
    """The GPT, Llama-family or Qwen3.5 model a Flax export's config.json (the model config's
    fields) describes."""
    from pstar_jax.io.checkpoint import CheckpointError
    from pstar_models import model_from_fields
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            fields = json.load(f)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        return model_from_fields(fields)
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path} does not describe a GPT, Llama-family or Qwen3.5 model "
                              f"({type(err).__name__}: {err}); pass a directory written by --export-flax") from None


def flax_source(directory: str) -> Source:
    from pstar_jax.io.flax_io import import_flax
    if not os.path.isdir(directory):
        raise ConfigError(f"--flax {directory} is not a directory")
    notes.info("reading the Flax export %s", directory)
    model = flax_model(directory)
    params = import_flax(directory, model.param_shapes())
    return Source(model, lambda: iter(params.items()), None, "bf16")


# -- text <-> ids -----------------------------------------------------------------------------


@dataclasses.dataclass
class Codec:
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int
    name: str


def byte_codec() -> Codec:
    from pstar_jax.data.corpus import SEPARATOR
    return Codec(lambda text: list(text.encode("utf-8")), lambda ids: bytes(ids).decode("utf-8", "replace"),
                 SEPARATOR[0], "bytes")


def hf_codec(path: str, eos_token: str | None) -> Codec:
    from pstar_jax.data.tokenizer import load_tokenizer
    encoder = load_tokenizer(path, eos_token)
    tok = encoder.tokenizer  # its post-processor adds a BOS where the model family wants one
    return Codec(lambda text: tok.encode(text, add_special_tokens=True).ids,
                 lambda ids: tok.decode(ids, skip_special_tokens=True), encoder.eos_id, encoder.name)


def choose_codec(tokenizer: str | None, fallback_dir: str | None, vocab_size: int, eos_token: str | None) -> Codec:
    from pstar_jax.data.token_files import BYTE_VOCAB_SIZE
    if tokenizer is None and fallback_dir and os.path.isfile(os.path.join(fallback_dir, "tokenizer.json")):
        tokenizer = fallback_dir
    if tokenizer is not None:
        return hf_codec(tokenizer, eos_token)
    if vocab_size == BYTE_VOCAB_SIZE:
        return byte_codec()
    raise ConfigError(f"the model has a vocabulary of {vocab_size} tokens and no tokenizer was found; pass "
                      "--tokenizer with its tokenizer.json")


def _check_text(text: str, what: str) -> None:
    """Refuse text that cannot be UTF-8 (an unpaired surrogate from JSON's escapes, or the
    surrogate escapes Python gives the bytes of a command-line argument that is not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ConfigError(f"{what} is not UTF-8 text (character {err.start} is "
                          f"{text[err.start].encode('utf-8', 'surrogatepass').hex(' ')}); give UTF-8 text") from None


def read_messages(path: str) -> list[dict[str, str]]:
    """A JSON list of chat messages, each {"role": system|user|assistant, "content": text}."""
    from pstar_jax.data.chat import ROLES
    try:
        with open(path, encoding="utf-8") as f:
            messages = json.load(f)
    except OSError as err:
        raise ConfigError(f"cannot read --messages {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ConfigError(f"--messages {path} is not JSON ({err})") from None
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages):
        raise ConfigError(f"--messages {path} must hold a non-empty JSON list of {{\"role\": "
                          f"{'|'.join(ROLES)}, \"content\": text}} objects")
    for i, message in enumerate(messages):
        _check_text(message["content"], f"--messages {path}: message {i}'s content")
    return messages


def generation_stop_ids(directories: Sequence[str | None]) -> list[int]:
    """eos_token_id of generation_config.json (an id or a list) in the first directory holding one."""
    for directory in directories:
        path = os.path.join(directory, "generation_config.json") if directory else None
        if path and os.path.isfile(path):
            try:
                with open(path) as f:
                    ids = json.load(f).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                raise ConfigError(f"{path} is not a JSON object; fix it or remove it") from None
            ids = [ids] if isinstance(ids, int) else ids or []
            return [i for i in ids if isinstance(i, int)]
    return []


def chat_prompt(args: argparse.Namespace, source: Source, codec: Codec) -> tuple[list[int], list[int]]:
    """The prompt ids of the chat template with the generation prompt, and the ids that end the answer."""
    from pstar_jax.data.chat import BadExample
    from pstar_jax.data.template import ChatTemplate, parse_template_kwargs
    directory = args.tokenizer or source.tokenizer_dir
    if directory is None:
        raise ConfigError("--chat needs the model's tokenizer directory (with its chat template); pass --tokenizer DIR")
    template = ChatTemplate.from_tokenizer_dir(directory, args.chat_template,
                                               kwargs=parse_template_kwargs(args.chat_template_kwargs))
    messages = read_messages(args.messages) if args.messages else [{"role": "user", "content": args.prompt}]
    try:
        ids = template.encode(template.render(messages, add_generation_prompt=True))
    except BadExample as err:
        raise ConfigError(f"the messages {err}") from None
    tokenizer_dir = directory if os.path.isdir(directory) else os.path.dirname(directory)
    stops = [*template.end_of_turn_ids(), *generation_stop_ids([tokenizer_dir, source.tokenizer_dir]), codec.eos_id]
    return ids, list(dict.fromkeys(stops))


def until_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    ids = [int(i) for i in ids]
    return ids[:next((k for k, i in enumerate(ids) if i in stop_ids), len(ids))]


# -- running ----------------------------------------------------------------------------------


def device_budget_bytes(device_memory: int | float | None, device: Any) -> int | None:
    """Bytes the decoder may use on ``device``: None means no limit (a CPU on auto)."""
    from pstar_jax.engine.memory import device_total_bytes
    if device_memory is None:
        return None if device.platform == "cpu" else int(0.9 * device_total_bytes(device))
    if isinstance(device_memory, float):
        return int(device_memory * device_total_bytes(device))
    return device_memory


def generate(source: Source, prompt_ids: list[int], n_new: int, sampling: Any, precision: str,
             device_memory: int | float | None, stream: bool, log: Callable[[str], None]
             ) -> tuple[np.ndarray, str, float]:
    """The new ids (a 1-D array), how they were made ('cached' or 'streamed') and the seconds the
    decoding took (loading the weights aside; the streamed path compiles during its first tokens)."""
    import jax
    import jax.numpy as jnp
    from pstar_jax.engine import decode

    model, dtype = source.model, jnp.bfloat16 if precision == "bf16" else jnp.float32
    _, shell = decode.decoder_shell(model, 0)
    limit = shell.max_decode_len()
    if len(prompt_ids) + n_new > limit:
        raise ConfigError(f"the prompt's {len(prompt_ids)} tokens and --max-new-tokens {n_new} exceed the model's "
                          f"{limit} positions; shorten the prompt or lower --max-new-tokens")
    prompt = np.asarray([prompt_ids], np.int32)
    budget = device_budget_bytes(device_memory, jax.devices()[0])
    cached, why_stream = None, ""
    if not stream and budget is not None and decode.params_bytes(model, dtype) >= budget:
        why_stream = f"the parameters ({format_bytes(decode.params_bytes(model, dtype))})"
    elif not stream:
        notes.info("compiling the decoder (%d prompt tokens, up to %d new)", len(prompt_ids), n_new)
        cached = decode.CachedDecoder(model, dtype, 1, len(prompt_ids), n_new, sampling)
        if budget is not None and cached.device_bytes() > budget:
            why_stream, cached = f"decoding on the device ({format_bytes(cached.device_bytes())})", None
    if cached is not None:
        notes.info("loading the weights onto the device")
        params = {n: jax.device_put(np.asarray(v).astype(dtype)) for n, v in source.tensors()}
        notes.info("decoding")
        start = time.perf_counter()
        return cached(params, prompt)[0], "cached", time.perf_counter() - start
    streamed = decode.StreamedDecoder(model, dtype)
    layer_bytes = decode.cache_bytes(model, 1, len(prompt_ids) + n_new, dtype) // model.n_layer
    peak = decode.stream_peak_bytes(streamed.stage_bytes(), layer_bytes)
    if budget is not None and peak > budget:
        raise ConfigError(f"the model does not fit --device-memory {format_bytes(budget)} even streamed: two stages' "
                          f"parameters and a layer's cache need {format_bytes(peak)}; raise --device-memory")
    if not stream:
        log(f"note: {why_stream} exceeds the device budget of {format_bytes(budget)}: streaming the parameters "
            "from host memory stage by stage (slow)")
    notes.info("loading the weights into host memory")
    streamed.load(source.tensors())
    notes.info("decoding (each stage compiles during the first tokens)")
    start = time.perf_counter()
    return streamed(prompt, n_new, sampling)[0], "streamed", time.perf_counter() - start


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not 0 <= args.seed <= MAX_SEED:
        raise ConfigError(f"--seed must be a whole number in [0, {MAX_SEED}], got {args.seed}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if (args.messages or args.chat_template or args.chat_template_kwargs) and not args.chat:  # before loading
        raise ConfigError("--messages, --chat-template and --chat-template-kwargs need --chat")
    _check_text(args.prompt, "--prompt")
    with cli.start_up_notes(not args.quiet, "pstar-generate"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from pstar_jax.engine.decode import Sampling

    from pstar_jax.engine.memory import configure_backend, host_budget_bytes
    configure_backend(args.device_memory, host_budget_bytes(None))  # before the backend starts
    if args.checkpoint_dir:
        source = checkpoint_source(args.checkpoint_dir, args.step, args.model_module)
    elif args.hf:
        source = hf_source(args.hf, args.model_module)
    else:
        source = flax_source(args.flax)
    try:
        codec = choose_codec(args.tokenizer, source.tokenizer_dir, source.model.vocab_size, args.eos_token)
        if args.chat:
            prompt_ids, stop_ids = chat_prompt(args, source, codec)
        else:
            prompt_ids, stop_ids = codec.encode(args.prompt) or [codec.eos_id], [codec.eos_id]
        too_large = [i for i in prompt_ids if i >= source.model.vocab_size]
        if too_large:
            raise ConfigError(f"the tokenizer {codec.name} gives id {max(too_large)}, outside the model's vocabulary "
                              f"of {source.model.vocab_size}; pass the model's own --tokenizer")
        # The decoder stops at one id (the end of turn in a chat); the output is cut at the first of any.
        sampling = Sampling(args.temperature, args.top_p, args.seed, stop_ids[0])
        log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        new_ids, how, seconds = generate(source, prompt_ids, args.max_new_tokens, sampling,
                                         args.precision or source.precision, args.device_memory, args.stream, log)
    finally:
        source.close()
    ids = until_stop(new_ids, stop_ids)
    if args.chat:  # the answer alone
        print(codec.decode(ids), flush=True)
    else:
        full, head = codec.decode([*prompt_ids, *ids]), codec.decode(prompt_ids)
        print(args.prompt + full[len(head):] if full.startswith(head) else full, flush=True)
    where = ("KV cache on the device, one compiled loop" if how == "cached"
             else "streamed stage by stage from host memory: slow, every token moves the whole model")
    log(f"pstar-generate: {len(new_ids)} new tokens in {seconds:.2f} s, {len(new_ids) / seconds:.1f} tokens/s "
        f"({where})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run_main("pstar-generate", run, argv, (DataError,))


if __name__ == "__main__":
    raise SystemExit(main())
