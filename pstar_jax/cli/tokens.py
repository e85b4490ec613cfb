"""pstar-tokens: text and JSONL files to a token file (pstar_jax.data.tokenizer), with ``--chat``
conversations to a packed SFT file (pstar_jax.data.sft), or with ``--preference`` preference pairs to
a packed preference file (pstar_jax.data.preference)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from pstar_jax.cli.flags import Parser
from pstar_jax.config.errors import ConfigError, DataError
from pstar_jax.data import token_files as data
from pstar_jax.data.chat import FORMATS
from pstar_jax.data import preference
from pstar_jax.data.sft import make_sft_file, summary
from pstar_jax.data.template import parse_template_kwargs
from pstar_jax.data.tokenizer import check_not_an_input, make_token_file


def _split_paths(paths: Sequence[str], output: str | None) -> tuple[str, list[str]]:
    """(OUT, inputs). With -o every path is an input. Without it, the old positional form: OUT is the
    one path named like a token file (*.u16.bin, *.u32.bin), first or last; anything else is ambiguous
    (``OUT.u16.bin IN.u16.bin`` once overwrote the file meant as input), so it is refused."""
    if output is not None:
        return output, list(paths)
    named = [i for i, p in enumerate(paths) if data.is_token_file_name(p)]
    if len(named) == 1 and named[0] in (0, len(paths) - 1):
        i = named[0]
        return paths[i], list(paths[:i]) + list(paths[i + 1:])
    shown = " ".join(paths[:3]) + (" ..." if len(paths) > 3 else "")
    raise DataError(f"cannot tell the output among {shown or 'no paths'}; name it with -o: "
                    f"pstar-tokens -o OUT.u16.bin INPUTS...")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pstar-tokens", usage="%(prog)s [options] -o OUT.u16.bin|OUT.u32.bin|OUT.sft.u16.bin INPUTS...",
        description="Make a token file: byte-level (vocab 256) by default, or with a Hugging Face "
                    "tokenizer. .jsonl inputs hold one document per line; other inputs are one "
                    "document each. With --chat: conversations (JSONL) rendered with the checkpoint's "
                    "chat template into a packed SFT file, trained on the assistant's tokens only. With --preference: "
                    "preference pairs (JSONL in TRL's formats) into a packed preference file for DPO.")
    parser.add_argument("paths", nargs="*", metavar="INPUT", help="input files, in order (without -o, the "
                        "one path named *.u16.bin/*.u32.bin, first or last, is the output)")
    parser.add_argument("-o", "--output", default=None, metavar="OUT", help="the token file to write")
    parser.add_argument("--tokenizer", default=None, metavar="DIR_OR_JSON",
                        help="a tokenizer.json or a directory holding one (default: bytes)")
    parser.add_argument("--eos-token", default=None,
                        help="end-of-text token (default: eos_token of tokenizer_config.json)")
    parser.add_argument("--field", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument("--default-corpus", action="store_true", help="use Python's stdlib sources")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="read at most this many input bytes (a document boundary counts 1; default: all)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (never an input)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    chat = parser.add_argument_group("conversations (--chat)")
    chat.add_argument("--chat", action="store_true", help="conversation JSONL to a packed SFT file "
                      "(OUT.sft.u16.bin); needs --tokenizer DIR and --seq-len")
    chat.add_argument("--chat-format", default=None, choices=FORMATS,
                      help="the JSONL format (default: detected per file from its first valid line)")
    chat.add_argument("--chat-template", default=None, metavar="FILE",
                      help="a Jinja chat template (default: the tokenizer's own)")
    chat.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                      help="extra template variables, a JSON object as transformers' apply_chat_template(**kwargs) "
                      "takes them, e.g. '{\"enable_thinking\": false}' for Qwen3 (the empty think block "
                      "then goes to the prompt, not the trained tokens)")
    chat.add_argument("--seq-len", type=int, default=None, help="the training sequence length: rows hold "
                      "seq_len + 1 tokens")
    chat.add_argument("--train-on-prompt", action="store_true",
                      help="train on every token, not only the assistant's")
    chat.add_argument("--truncate", action="store_true", help="keep the beginning of an example longer than "
                      "a row (default: drop it); with --preference, cut a pair longer than a row as TRL's "
                      "max_prompt_length and max_completion_length cut: the prompt keeps its last tokens (cut only as "
                      "far as whole completions need, and to no less than a quarter of the row), each completion "
                      "its first")
    chat.add_argument("--on-bad-example", choices=("error", "skip"), default="error",
                      help="a malformed line stops with its file:line (error, the default) or is skipped and counted")
    chat.add_argument("--seed", type=int, default=0, help="packing seed (default: 0)")
    pairs = parser.add_argument_group("preference pairs (--preference)")
    pairs.add_argument("--preference", action="store_true", help="preference JSONL (prompt/chosen/rejected as "
                       "TRL reads them: text, message lists, or an implicit prompt) to a packed preference file "
                       "(OUT.sft.u16.bin) for DPO; each pair in one row, so --seq-len bounds both its sequences "
                       "together; needs --tokenizer DIR and --seq-len (takes --chat-template, "
                       "--chat-template-kwargs, --truncate, --on-bad-example, --seed, --eos-token)")
    return parser


_CHAT_ONLY = ("chat_format", "chat_template", "chat_template_kwargs", "seq_len", "train_on_prompt", "truncate")


# Flags --preference refuses (one line), with why.
_NOT_FOR_PREFERENCE = {"chat": "pass one of --chat (conversations) and --preference (pairs)",
                       "chat_format": "the preference format is read from each line's fields",
                       "train_on_prompt": "DPO trains on the completions only",
                       "default_corpus": "it makes a token file", "max_bytes": "it applies to token files",
                       "field": "the fields are prompt, chosen and rejected"}


def _check_packed_flags(args: argparse.Namespace, mode: str) -> None:
    if args.tokenizer is None or args.seq_len is None:
        raise DataError(f"--{mode} needs --tokenizer DIR (the checkpoint's Hugging Face tokenizer directory) "
                        "and --seq-len (the training sequence length)")
    for flag in ("default_corpus", "max_bytes"):
        if getattr(args, flag) not in (None, False):
            raise DataError(f"--{flag.replace('_', '-')} does not apply to --{mode}")


def _skipped_lines(info: dict) -> list[str]:
    lines = [f"skipped {line}" for line in info["skipped_named"]]
    if info["skipped"] > len(info["skipped_named"]):
        lines.append(f"... and {info['skipped'] - len(info['skipped_named']):,} more skipped")
    return lines


def _run_preference(args: argparse.Namespace, out: str, inputs: list[str]) -> str:
    for flag, why in _NOT_FOR_PREFERENCE.items():
        if getattr(args, flag) not in (None, False, "text"):
            raise DataError(f"--{flag.replace('_', '-')} does not apply to --preference: {why}")
    _check_packed_flags(args, "preference")
    info = preference.make_preference_file(
        out, inputs, args.tokenizer, args.seq_len, chat_template=args.chat_template, truncate=args.truncate,
        on_bad_example=args.on_bad_example, seed=args.seed, eos_token=args.eos_token, overwrite=args.overwrite,
        chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs))
    return "\n".join(_skipped_lines(info) + [preference.summary(out, info)])


def _run_chat(args: argparse.Namespace, out: str, inputs: list[str]) -> str:
    _check_packed_flags(args, "chat")
    info = make_sft_file(out, inputs, args.tokenizer, args.seq_len, chat_format=args.chat_format,
                         chat_template=args.chat_template, train_on_prompt=args.train_on_prompt,
                         truncate=args.truncate, on_bad_example=args.on_bad_example, seed=args.seed,
                         eos_token=args.eos_token, overwrite=args.overwrite,
                         chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs))
    return "\n".join(_skipped_lines(info) + [summary(out, info)])


def main(argv: Sequence[str] | None = None) -> int:
    """``pstar-tokens``: writes a token file from text and JSONL files or the default corpus, or with
    ``--chat`` a packed SFT file from conversations."""
    parser = build_parser()
    try:
        args = parser.parse_intermixed_args(argv)  # inputs may come before and after the options
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except ConfigError as e:  # a usage error, in one line (argparse would print the usage above it)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    out = None
    try:
        out, inputs = _split_paths(args.paths, args.output)
        check_not_an_input(Path(out), [Path(p) for p in inputs])
        if Path(out).is_file() and not args.overwrite:  # (the library's words name its argument)
            raise DataError(f"{out} already exists; pass --overwrite to replace it")
        if args.preference:
            print(_run_preference(args, out, inputs))
            return 0
        if args.chat:
            print(_run_chat(args, out, inputs))
            return 0
        given = [f for f in _CHAT_ONLY if getattr(args, f) not in (None, False)]
        if given:
            raise DataError(f"--{given[0].replace('_', '-')} needs --chat or --preference")
        info = make_token_file(out, inputs, tokenizer=args.tokenizer, eos_token=args.eos_token,
                               field=args.field, default_corpus=args.default_corpus,
                               max_bytes=args.max_bytes, overwrite=args.overwrite,
                               progress=False if args.quiet else None)
    except (DataError, OSError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted; {out or 'the output'} was left as it was", file=sys.stderr)
        return 130
    print(f"wrote {info['num_tokens']:,} {info['dtype']} tokens to {out} (vocabulary "
          f"{info['vocab_size']:,}, eos id {info['eos_id']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
