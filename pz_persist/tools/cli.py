"""The ``pz-persist`` command: look at, compare, verify and list checkpoints,
and convert pretrained weights to native ones.

Exit status follows ``diff``: 0 on success (for ``diff``: identical), 1 when
``diff`` finds differences or ``verify`` finds damage, 2 on errors (bad
arguments, not a checkpoint), and for ``verify`` 3 when a checkpoint could
not be checked (`COULD_NOT_CHECK`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shutil
import sys
from typing import Any
from typing import TextIO

from pz_persist import errors
from pz_persist import progress as progress_lib
from pz_persist import version
from pz_persist.safety import terminal
from pz_persist.storage import destinations
from pz_persist.storage import stores
from pz_persist.storage.lifecycle import leftovers
from pz_persist.storage.lifecycle import steps
from pz_persist.storage.reading import opening
from pz_persist.tools import diff_view
from pz_persist.tools import diffing
from pz_persist.tools import verifying
from pz_persist.tools import viewing


def _print(text: str = "", *, file: TextIO | None = None) -> None:
  """Prints ``text`` with every escape sequence neutralized (the one place
  this command prints: much of what it shows comes from the checkpoint)."""
  print(terminal.printable(text), file=file or sys.stdout)


def _one_line(text: str) -> str:
  """A value from the checkpoint that must not start a line of its own."""
  return terminal.printable(text, newlines=False)


def _inspect(args: argparse.Namespace) -> int:
  if args.html:  # The destination rule, before anything is read or printed.
    destinations.check_output(args.html, [args.path], file=True)
  paths = opening.items(args.path)  # A step's items, each in turn.
  if args.json:
    _print_json(viewing.JSON_SCHEMA_INSPECT, {
        "path": str(args.path),
        "items": [viewing.checkpoint_record(path) for path in paths],
    })
    return 0
  if len(paths) > 1:
    _print(f"{_one_line(args.path)}: {len(paths)} items"
           f" ({', '.join(_one_line(path.name) for path in paths)})\n")
  _print("\n\n".join(viewing.describe_checkpoint(path) for path in paths))
  if args.html:
    out = viewing.render_html(args.path, args.html, arrays=args.arrays)
    _print(f"\nwrote {out}")
  _note_leftovers(leftovers.find(*stores.choose(args.path)), args.path)
  return 0


def _print_json(schema: str, record: dict[str, Any]) -> None:
  """One JSON object on one line of stdout, ``schema`` first (its name and version: see
  docs/reference/cli-json.md). ASCII only, so a checkpoint's names cannot
  send escape sequences to a terminal; no NaN or infinity, so any JSON
  parser reads it."""
  print(json.dumps({"schema": schema, **record}, ensure_ascii=True, allow_nan=False))


def _note_leftovers(found: list[leftovers.Leftover], where: str) -> None:
  """One line about leftovers of unfinished saves, if any (see ``clean``)."""
  line = leftovers.summary(found, where)
  if line:
    _print(f"\n{line}")


def _clean(args: argparse.Namespace) -> int:
  found = leftovers.find_all(args.path)
  if not found:
    _print(f"no leftovers of unfinished saves beside or in {args.path}")
    return 0
  kept = 0
  for leftover in found:
    removed = not args.dry_run and leftovers.remove(leftover, force=args.force)
    kept += not removed
    verb = "removed" if removed else "would remove" if args.dry_run and (
        leftovers.would_remove(leftover, force=args.force)) else "kept"
    _print(f"{verb} {_one_line(leftover.name)} ({terminal.size_text(leftover.nbytes)}):"
          f" {leftover.status}, {leftover.reason}")
  if kept and not args.force and not args.dry_run:
    if not stores.for_path(args.path).has_locks:
      _print("kept them: on an object store nothing proves a save or a step"
            " finished or dead (no locks, no pids); --force removes them once"
            " you know nothing writes there any more.")
    else:
      _print("kept ones whose writer may still be running; --force also removes"
            " those not provably live (no marker, another host, Orbax's"
            " unfinished steps) once you know nothing writes them.")
  return 0


def _number(x: float) -> str:
  return f"{x:.3g}"


def _diff(args: argparse.Namespace) -> int:
  if args.html:  # The destination rule, before the (long) comparison.
    destinations.check_output(args.html, [args.a, args.b], file=True)
  result = diffing.diff(args.a, args.b, batch_bytes=args.batch_mib * 2**20,
                        progress=_progress(args))
  if args.html:
    out = result.save_html(args.html)
  if args.json:
    _print_json(diffing.JSON_SCHEMA, {"a": str(args.a), "b": str(args.b),
                                      **diffing.record(result)})
    return 0 if result.identical else 1
  if not result.identical or args.all:
    # The table escapes the checkpoint's text itself; only its own colour
    # codes are left as they are (on a terminal only).
    color = diff_view.use_colour(sys.stdout)
    text = result.table(width=_width(), color=color, every_array=args.all)
    print(text if color else terminal.printable(text))
    _print()
  differing = sum(not a.identical for a in result.arrays)
  if args.html:
    _print(f"wrote {out}")
  if result.identical:
    _print(f"identical: {len(result.arrays)} array(s) compared")
    return 0
  _print(f"{differing} of {len(result.arrays)} compared array(s) differ")
  return 1


def _width() -> int:
  """The terminal's columns (``COLUMNS`` if set), 120 when not a terminal."""
  return shutil.get_terminal_size(fallback=(120, 24)).columns


DAMAGED = 1
"""``verify``'s exit status when it found damage (as ``diff``'s differences)."""

COULD_NOT_CHECK = 3
"""``verify``'s exit status when a checkpoint could not be checked and none
was found damaged: verify itself failed (an unexpected error in pz_persist or
a library it uses, or the machine ran out of memory), which says nothing
about the checkpoint. Distinct from `DAMAGED` (1), so that a script never
deletes or restores a healthy checkpoint because a check crashed, and from
2 (bad arguments, not a checkpoint)."""


def _verify(args: argparse.Namespace) -> int:
  records: list[dict[str, Any]] = []
  damaged = unchecked = 0
  for path in args.paths:
    try:
      report = verifying.verify(path, progress=_progress(args))
    except errors.PzPersistError:
      raise  # Not a checkpoint, refused: an error (2), said by `main`.
    except Exception as e:  # pylint: disable=broad-except
      # A failure of the check itself: not damage, and not to be hidden.
      unchecked += 1
      problem = f"{type(e).__name__}: {e}"
      records.append(verifying.unchecked_record(path, problem))
      _print(
          f"pz-persist: could not check {path}: verify failed ({_one_line(problem)[:500]})."
          " This is not damage: the checkpoint may be intact. Please report it"
          " (exit status 3).", file=sys.stderr)
      continue
    damaged += not report.ok
    records.append(report.record())
    if not args.json:
      _print(str(report))
  if args.json:
    _print_json(verifying.JSON_SCHEMA, {
        "ok": not damaged and not unchecked,
        "checkpoints": records,
    })
  return DAMAGED if damaged else COULD_NOT_CHECK if unchecked else 0


def _ls(args: argparse.Namespace) -> int:
  found = steps.list_steps(args.directory)
  if args.json:
    _print_json(JSON_SCHEMA_LS, {
        "directory": str(args.directory),
        "steps": [
            {
                "step": info.step,
                "path": str(info.path),
                "committed": info.committed,
                "items": list(info.items),
                "pz_persist_items": list(info.penzai_items),
                "bytes": info.nbytes,
                "committed_at": _when(info.commit_time_ns, iso=True),
            }
            for info in found
        ],
        "leftovers": [
            {"name": str(leftover.name), "bytes": leftover.nbytes, "status": leftover.status}
            for leftover in leftovers.find_all(args.directory)
        ],
    })
    return 0
  if not found:
    _print(f"no steps in {args.directory}")
    _note_leftovers(leftovers.find_all(args.directory), args.directory)
    return 0
  rows = []
  for info in found:
    items = ", ".join(
        _one_line(name) + ("*" if name in info.penzai_items else "")
        for name in info.items
    )
    rows.append([str(info.step), "yes" if info.committed else "no (partial)",
                 items or "-", terminal.size_text(info.nbytes),
                 _when(info.commit_time_ns) or "-"])
  _print(viewing.format_table(["step", "committed", "items", "size", "committed at"],
                              rows, right=("step", "size"), width=_width(),
                              wrap=("items", "committed at")))
  _print("\n* items written by pz_persist")
  _note_leftovers(leftovers.find_all(args.directory), args.directory)
  return 0


JSON_SCHEMA_LS = "pz-persist.ls/1"
"""The ``schema`` of ``pz-persist ls --json`` (docs/reference/cli-json.md)."""


def _when(time_ns: int | None, *, iso: bool = False) -> str | None:
  """A commit time in UTC: ``2026-11-25 20:37:54 UTC``, or ISO 8601 for JSON."""
  if time_ns is None:
    return None
  when = datetime.datetime.fromtimestamp(time_ns / 1e9, datetime.UTC)
  if iso:
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")
  return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def _progress(args: argparse.Namespace) -> progress_lib.Progress:
  """Bars on a terminal (stderr), none with ``--quiet`` or in logs."""
  return False if args.quiet else None


def _convert(args: argparse.Namespace) -> int:
  """Loads pretrained weights once and writes them as a native checkpoint,
  which `pz_persist.load_model` then reloads without any conversion."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from pz_persist import model as model_lib

  # Before the (long) load: a bad scheme, a missing extra, an existing DST,
  # a DST that is (or holds, or is inside) SRC; local or on an object store.
  dst = destinations.check_output(args.dst, [args.src])
  if dst.exists() and not args.overwrite:
    raise errors.CheckpointExistsError(
        f"{args.dst} exists; pass --overwrite to replace it."
    )
  dtype = None if args.dtype is None else jnp.dtype(args.dtype)
  if args.format == "gemma":
    from pz_persist.pretrained import gemma  # pylint: disable=import-outside-toplevel

    preset = {"like": args.preset_like} if args.preset_like else args.preset
    model = gemma.load_gemma(args.src, preset=preset, dtype=dtype, allow_lossy=args.allow_lossy,
                             progress=_progress(args))
  else:
    from pz_persist.pretrained import hf  # pylint: disable=import-outside-toplevel

    model = hf.load_hf(args.src, dtype=dtype, allow_lossy=args.allow_lossy,
                       allow_unread=args.allow_unread, progress=_progress(args))
  # Orbax writes the checkpoint in one call: one step, showing the time taken.
  with progress_lib.tracking(_progress(args), f"writing {args.dst}", 1,
                             unit="checkpoint") as tracker:
    model_lib.save_model(args.dst, model, overwrite=args.overwrite)
    tracker.advance()
  _print(f"wrote {args.dst}; reload it with pz_persist.load_model({args.dst!r})")
  return 0


def _export(args: argparse.Namespace) -> int:
  """Writes a native checkpoint of a transformer as a Hugging Face folder."""
  from pz_persist import model as model_lib
  from pz_persist.pretrained.hf import export as hf_export  # pylint: disable=import-outside-toplevel

  # Before the (long) load: a destination that is (or holds) the source, or
  # that is not an earlier export's folder; the export checks again.
  dst = os.fspath(destinations.check_output(args.dst, [args.src, *hf_export.like_sources(args.like)]))
  hf_export.check_destination(dst, args.overwrite)
  model = model_lib.load_model(args.src)
  shard_size = args.shard_mib * 2**20 if args.shard_mib else hf_export.DEFAULT_SHARD_BYTES
  hf_export.export_hf(model, args.dst, like=args.like, shard_size=shard_size,
                      overwrite=args.overwrite, progress=_progress(args))
  _print(f"wrote {args.dst}; transformers reads it with"
         f" AutoModelForCausalLM.from_pretrained({args.dst!r})")
  return 0


def _migrate(args: argparse.Namespace) -> int:
  """Loads a plain Orbax checkpoint into the model the user's function builds,
  and writes it as a native checkpoint."""
  from pz_persist.tools import migrating

  # The destination rule before the user's code builds the model (and again
  # in `migrate`, for every caller).
  destinations.check_output(args.dst, [args.src])
  if os.getcwd() not in sys.path:  # As `python -m` would: the user's modules.
    sys.path.insert(0, os.getcwd())
  model = migrating.build_model(args.model)
  migrating.migrate(
      args.src, args.dst, model, overwrite=args.overwrite,
      allow_modules=args.allow_module,
  )
  _print(f"wrote {args.dst}; reload it with pz_persist.load_model({args.dst!r})")
  return 0


def _installed(package: str) -> str:
  """The installed version of ``package``, for ``--version``."""
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def build_parser() -> argparse.ArgumentParser:
  # The help of convert and export lists the families their records declare.
  from pz_persist.pretrained.hf import families as hf_families  # pylint: disable=import-outside-toplevel

  parser = argparse.ArgumentParser(
      prog="pz-persist",
      description="Look at, compare and list pz_persist (Orbax) checkpoints.",
  )
  parser.add_argument(
      "--version", action="version",
      version=f"%(prog)s {version.__version__} (orbax-checkpoint"
      f" {_installed('orbax-checkpoint')}, penzai {_installed('penzai')},"
      f" jax {_installed('jax')})",
  )
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

  inspect = commands.add_parser(
      "inspect",
      help="table of a checkpoint's arrays (label, axes, shape, dtype, bytes)",
      description="Print a checkpoint's arrays without reading them: label, axis"
      " names, shape, dtype and size. Given a step of a run (RUN/STEP), each"
      " of its items in turn.",
  )
  inspect.add_argument("path", help="checkpoint directory (or its item directory, or a step"
                       " directory RUN/STEP)")
  inspect.add_argument("--html", metavar="OUT", help="also write a treescope HTML view")
  inspect.add_argument(
      "--arrays", action="store_true",
      help="with --html: load the arrays to show value summaries",
  )
  inspect.add_argument("--json", action="store_true",
                       help="print JSON (schema pz-persist.inspect/1) instead of tables")
  inspect.set_defaults(run=_inspect)

  diff = commands.add_parser(
      "diff",
      help="compare two checkpoints (structure and values)",
      description="Compare checkpoints A and B as one tree matched by path:"
      " layers wrapped, added, removed or replaced, labels, metadata, axis names,"
      " shapes and dtypes, then the values of each array (max and relative norm"
      " of the difference, fraction of elements changed), reading a bounded"
      " batch of arrays at a time. Exits 0 if identical, 1 if they differ.",
  )
  diff.add_argument("a")
  diff.add_argument("b")
  diff.add_argument("--all", action="store_true", help="list identical arrays too")
  diff.add_argument(
      "--batch-mib", type=int, default=diffing.DEFAULT_BATCH_BYTES // 2**20,
      help="most MiB read from each checkpoint at once (default: %(default)s)",
  )
  diff.add_argument("--quiet", action="store_true", help="no progress bar")
  diff.add_argument("--json", action="store_true",
                    help="print JSON (schema pz-persist.diff/1) instead of tables")
  diff.add_argument("--html", metavar="OUT.html",
                    help="also write the diff as a self-contained treescope HTML page")
  diff.set_defaults(run=_diff)

  verify = commands.add_parser(
      "verify",
      help="check every file and array against its recorded checksum",
      description="Read each checkpoint whole and compare every file and every"
      " array with the checksums recorded when it was saved; name every damaged"
      " file and label. Exits 0 if all are intact, 1 if any is damaged, 2 on"
      " errors (not a checkpoint), 3 if one could not be checked (verify"
      " itself failed: not damage) and none is damaged.",
  )
  verify.add_argument("paths", nargs="+", metavar="path")
  verify.add_argument("--quiet", action="store_true", help="no progress bars")
  verify.add_argument("--json", action="store_true",
                      help="print JSON (schema pz-persist.verify/1) instead of text")
  verify.set_defaults(run=_verify)

  ls = commands.add_parser(
      "ls",
      help="list the steps of a checkpoint directory",
      description="List the steps of an Orbax checkpoint directory (such as a"
      " CheckpointManager's): committed or not, items, size, commit time.",
  )
  ls.add_argument("directory")
  ls.add_argument("--json", action="store_true",
                  help="print JSON (schema pz-persist.ls/1) instead of a table")
  ls.set_defaults(run=_ls)

  clean = commands.add_parser(
      "clean",
      help="remove what unfinished (killed, interrupted) saves left",
      description="Remove the hidden leftovers of saves that did not finish,"
      " beside a checkpoint path or inside a directory, printing each with"
      " its size. Only those whose writer is provably gone are removed: its"
      " marker's lock is free and it was written on this host by a process"
      " that has exited (or before a restart). Others are listed and kept.",
  )
  clean.add_argument("path", help="checkpoint path, or a directory of checkpoints or steps")
  clean.add_argument(
      "--force", action="store_true",
      help="also remove leftovers whose writer cannot be checked (no marker,"
      " another host or container) and Orbax's unfinished CheckpointManager"
      " steps; never those of a running writer (a save holding its marker's"
      " lock, or a CheckpointManager that has the run open)",
  )
  clean.add_argument("--dry-run", action="store_true", help="only list them")
  clean.set_defaults(run=_clean)

  convert = commands.add_parser(
      "convert",
      help="convert pretrained weights (Gemma, Hugging Face) to a native checkpoint",
      description="Load pretrained weights once (an official Gemma Flax"
      " checkpoint, or a Hugging Face folder of a family load_hf reads:"
      f" {hf_families.names()}) and save them as a pz_persist checkpoint, which"
      " pz_persist.load_model reloads without converting again.",
  )
  convert.add_argument("format", choices=["gemma", "hf"])
  convert.add_argument("src", help="the checkpoint folder to read")
  convert.add_argument("dst", help="the native checkpoint to write")
  convert.add_argument("--dtype", help="cast while reading, e.g. bfloat16 (floats are"
                       " rounded; a cast changing values beyond that is refused)")
  convert.add_argument("--allow-lossy", action="store_true",
                       help="cast with --dtype even where values change beyond rounding")
  convert.add_argument("--allow-unread", action="store_true",
                       help="hf: load a folder storing tensors the model does not read,"
                       " leaving them out with a warning (as transformers does)")
  convert.add_argument("--overwrite", action="store_true", help="replace DST")
  convert.add_argument(
      "--preset", default="auto",
      help="gemma: Penzai preset name, e.g. gemma2_9b (default: from shapes)",
  )
  convert.add_argument(
      "--preset-like", metavar="PRESET",
      help="gemma: sizes from the checkpoint, other settings from PRESET",
  )
  convert.add_argument("--quiet", action="store_true", help="no progress bars")
  convert.set_defaults(run=_convert)

  export = commands.add_parser(
      "export",
      help="write a native checkpoint of a transformer as a Hugging Face folder",
      description="Load a pz_persist checkpoint of a Penzai transformer (saved"
      " with pz_persist.save_model or pz-persist convert) and write it as a"
      " Hugging Face folder (config.json, sharded safetensors and their index)"
      " that transformers, vLLM and llama.cpp's converters read.",
  )
  export.add_argument("format", choices=["hf"])
  export.add_argument("src", help="the pz_persist checkpoint to read")
  export.add_argument("dst", help="the folder to write")
  export.add_argument(
      "--like", metavar="FAMILY_OR_FOLDER",
      help=f"hf: the model_type ({', '.join(hf_families.EXPORTED)}) or a Hugging"
      " Face folder whose model_type and token ids, architectures... are used"
      " (default: the family the model's structure shows)",
  )
  export.add_argument("--shard-mib", type=int,
                      help="most MiB per safetensors file (default: 5 GiB, as transformers)")
  export.add_argument("--overwrite", action="store_true", help="replace DST")
  export.add_argument("--quiet", action="store_true", help="no progress bars")
  export.set_defaults(run=_export)

  migrate = commands.add_parser(
      "migrate",
      help="convert a plain Orbax checkpoint of a model's params to a native one",
      description="Load a checkpoint written without pz_persist (the params"
      " of pz.unbind_params(model, freeze=True) saved with Orbax's"
      " StandardCheckpointer or PyTreeCheckpointer) into the model that"
      " --model builds, checking every shape and dtype, and save it as a"
      " pz_persist checkpoint, which pz_persist.load_model reloads with no code."
      " --model IMPORTS AND RUNS the code you name (from the current directory"
      " or PYTHONPATH): name only code you trust. Loading the result never"
      " runs code.",
  )
  migrate.add_argument("src", help="the plain Orbax checkpoint to read")
  migrate.add_argument("dst", help="the native checkpoint to write")
  migrate.add_argument(
      "--model", required=True, metavar="MODULE:FUNCTION",
      help="a function taking no arguments that builds the model (its labels,"
      " axes, shapes and dtypes), e.g. my_models:build_mlp; it is imported and"
      " called",
  )
  migrate.add_argument(
      "--allow-module", action="append", metavar="MODULE",
      help="a module the model's own layer classes come from (repeatable)",
  )
  migrate.add_argument("--overwrite", action="store_true", help="replace DST")
  migrate.set_defaults(run=_migrate)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel

  absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax is chatty.
  try:
    return args.run(args)
  except BrokenPipeError:  # Output piped into `head` and cut short: fine.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
  except errors.PzPersistError as e:
    _print(f"pz-persist: error: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # Not a raw "[Errno 2] ...": the path, then the reason.
    where = f"{e.filename}: " if e.filename is not None else ""
    _print(f"pz-persist: error: {where}{(e.strerror or str(e)).lower()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
