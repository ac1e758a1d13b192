"""An operation's options, each declared once: a request's field (`ops/requests.py`) carries its
command-line spelling, type, default and help, and `kvtool.cli.commands` builds the command
from them. Plain data: nothing here imports typer or torch.

    model_dtype: str = option("fp32", "--model-dtype", metavar="DTYPE", help="...")

A field without a `Flag` (made with `dataclasses.field`) is the Python API's alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the key of a request field's metadata that holds its `Flag`
FLAG = "kvtool.flag"


@dataclass(frozen=True)
class Flag:
    """How one field of a request is spelled on the command line.

    `kind`: the value's type there (str, int, float, bool, Path, list); a field whose default is
    None takes no value when the option is not given. `argument`: a positional argument
    (`flags[0]` its metavar). `negate`: a `--no-...` switch that sets the field False (the
    field's default is True). `off`: a hidden `--no-...` switch beside a tri-state bool
    (None: the codec's default)."""

    flags: tuple[str, ...]
    kind: type
    help: str
    metavar: str | None = None
    argument: bool = False
    negate: bool = False
    off: str | None = None
    hidden: bool = False
    show_default: bool = True

    @property
    def name(self) -> str:
        """The spelling a message names it by: its long flag, or an argument's name ("FILE")."""
        return self.flags[0].strip("[]") if self.argument else self.flags[-1]


def option(default: Any, *flags: str, kind: type = str, help: str, metavar: str | None = None,
           argument: bool = False, negate: bool = False, off: str | None = None, hidden: bool = False,
           show_default: bool | None = None) -> Any:
    """A request's field that is also a command-line option (or, `argument`, a positional one)."""
    if show_default is None:  # (a required one, `dataclasses.MISSING`, has none to show)
        show_default = default not in (None, dataclasses.MISSING) and kind is not bool
    return dataclasses.field(default=default, metadata={FLAG: Flag(
        flags=flags, kind=kind, help=help, metavar=metavar, argument=argument, negate=negate, off=off,
        hidden=hidden, show_default=show_default)})


def flag_of(field: dataclasses.Field) -> Flag | None:
    """A field's `Flag`, or None: the Python API's alone."""
    return field.metadata.get(FLAG)


# --- options several operations share, declared once here ------------------------------------


def model_option() -> Any:
    return option(None, "--model", kind=Path, metavar="DIR|ID", help=(
        "A Hugging Face model folder, or a Hub id (org/name) in the local cache (nothing is downloaded); "
        "default: the embedded SmolLM2-135M-Instruct."))


def device_option() -> Any:
    return option("auto", "--device", metavar="DEVICE", help="auto (a GPU if torch sees one), cpu, cuda or cuda:N.")


def model_dtype_option() -> Any:
    return option("fp32", "--model-dtype", metavar="DTYPE",
                  help="The model's weights and arithmetic: fp32, bf16 or fp16.")


def engine_option() -> Any:
    return option("kvtool", "--engine", metavar="ENGINE", show_default=False,
                  help="kvtool (default), hf (transformers).")


def other_weights_option() -> Any:
    return option(False, "--allow-other-weights", kind=bool,
                  help="Accept KV computed with other weights (said in the report).")


def generation_prompt_option() -> Any:
    return option(True, "--no-generation-prompt", kind=bool, negate=True, help="--chat: open no assistant turn.")


STORE_HELP = "The chunk store: a folder, file://, redis://, redis+cluster://."


def store_option(required: bool = False) -> Any:
    """`--store URL`; a value the command must be given when `required` (a field without default:
    declare it before the fields with one). Never in a repr: a URL may carry a password."""
    field = option(dataclasses.MISSING if required else None, "--store", metavar="URL", help=STORE_HELP,
                   show_default=False)
    field.repr = False
    return field


def namespace_option() -> Any:
    return option(None, "--namespace", metavar="NAME", show_default=False,
                  help="The store's partition: its chunks are never served to another.")


def input_file_argument() -> Any:
    # str, not Path: a Path would turn "https://host/f.kvc" into "https:/host/f.kvc" in messages
    return option(dataclasses.MISSING, "FILE", argument=True, help="A kvtool file (.kvc).")


def output_option(help: str = "Output path.", required: bool = True) -> Any:
    return option(dataclasses.MISSING if required else None, "-o", "--output", kind=Path, metavar="OUT", help=help,
                  show_default=False)


def continue_option(default: int = 32, help: str = "Tokens to generate (they stop at end of sequence).") -> Any:
    return option(default, "--continue", kind=int, metavar="N", help=help)


def compare_option() -> Any:
    return option(False, "--compare", kind=bool, help="Also recompute in full, and compare.")


def store_chunk_size_option() -> Any:
    return option(None, "--chunk-size", kind=int, metavar="N",
                  help="With --store: the chunk size (default: the one covering most).")


def min_top1_option(help: str = "Exit 1 below this top-1 agreement (implies --compare).") -> Any:
    return option(None, "--min-top1", kind=float, metavar="X", help=help)


def max_kl_option(help: str = "Exit 1 above this mean KL divergence (implies --compare).") -> Any:
    return option(None, "--max-kl", kind=float, metavar="X", help=help)


# the codec's options (`compress`, `capture`; `store get` takes `--codec` alone)


def codec_option(default: str | None, help: str = "Codec: raw, zstd, cachegen or pca.") -> Any:
    return option(default, "--codec", metavar="CODEC", help=help)


def level_option() -> Any:
    return option(None, "--level", kind=int, metavar="N",
                  help="zstd level (default 1: on shuffled KV it beats 3 in ratio and speed).")


def shuffle_option() -> Any:
    # (--no-shuffle out of the help: a --shuffle/--no-shuffle pair takes a column of every line of it)
    return option(None, "--shuffle", kind=bool, off="--no-shuffle", show_default=False,
                  help="zstd: shuffle byte planes first (default; --no-shuffle: off).")


def bins_option() -> Any:
    return option(None, "--bins", metavar="SPEC",
                  help="cachegen: bins per layer, e.g. 'k:0-10=32,10-=16;v:0-=16' (cachegen.md §2).")


def quality_option() -> Any:
    # (told short: one line in capture's help, which fits a screen; README says what each promises)
    return option(None, "--quality", metavar="Q", help="pca: 99, 97 (default), 95 or 89.")


def bitstream_option() -> Any:
    return option(None, "--bitstream", kind=int, metavar="N",
                  help="pca: 1 (default) or 2 (GPU units).")


def calibration_option() -> Any:
    return option(None, "--calibration", metavar="DIGEST", help="pca: default: the model's own.")


def embed_calibration_option() -> Any:
    return option(False, "--embed-calibration", kind=bool, help="pca: carry it in the file.")


# a prompt's tokens (`capture`, `store get`)


def prompt_option(help: str = "Prompt text.") -> Any:
    return option(None, "--prompt", metavar="TEXT", help=help)


def prompt_file_option(help: str = "File with the prompt (UTF-8).") -> Any:
    return option(None, "--prompt-file", kind=Path, metavar="FILE", help=help)


def tokens_option() -> Any:
    return option(None, "--tokens", kind=Path, metavar="FILE",
                  help="File of token ids (JSON list or whitespace-separated).")





# --- a request made of parts, and a request from its fields' values ------------------------------

#: the key of a field's metadata naming the request class it holds (a part: its options are the
#: outer request's too, e.g. `PromptCaptureRequest.capture`)
PART = "kvtool.part"


def part(request_class: type) -> Any:
    """A field holding another request whose options are this request's too."""
    return dataclasses.field(metadata={PART: request_class})


def part_of(field: dataclasses.Field) -> type | None:
    return field.metadata.get(PART)


def make(request_class: type, values: dict[str, Any]) -> Any:
    """`request_class` made from `values`, its fields' (its parts' included) by name: the Python
    API's keyword arguments, one line. A name that is no field is a TypeError, as a call's is."""
    left = dict(values)
    made = _make(request_class, left)
    if left:
        raise TypeError(f"{request_class.__name__} has no option {', '.join(map(repr, left))}")
    return made


def _make(request_class: type, left: dict[str, Any]) -> Any:
    kwargs = {}
    for field in dataclasses.fields(request_class):
        if part_of(field) is not None:
            kwargs[field.name] = _make(part_of(field), left)
        elif field.init and field.name in left:
            kwargs[field.name] = left.pop(field.name)
    return request_class(**kwargs)


def options_of(request_class: type) -> list[tuple[dataclasses.Field, Flag]]:
    """Every field of `request_class` (its parts' in their place) that is a command-line option,
    in declaration order."""
    found = []
    for field in dataclasses.fields(request_class):
        if part_of(field) is not None:
            found.extend(options_of(part_of(field)))
        elif flag_of(field) is not None:
            found.append((field, flag_of(field)))
    return found
__all__ = ["FLAG", "Flag", "PART", "STORE_HELP", "flag_of", "make", "option", "options_of", "part", "part_of"]
