"""`mpiasgd data convert | synth | info`: make and inspect dataset files (mpiasgd.data.h5data's format).

    mpiasgd data convert ~/data/imagenet-folders imagenet224.h5 --size 224   # train/<class>/*.jpg, val/...
    mpiasgd data convert ~/.cache/mpiasgd cifar10.h5                       # either official CIFAR-10 layout
    mpiasgd data convert ~/data/Imagenet64 imagenet64.h5                   # train_data_batch_1..10, val_data
    mpiasgd data synth synthetic64.h5 --count 128000 --size 64             # ImageNet-shaped, 1000 classes
    mpiasgd data info imagenet64.h5

A bad source or file prints one line, `mpiasgd data ACTION: error: ...`, and exits with status 2; Ctrl-C
(SIGINT) and SIGTERM stop it with no output file left, status 130 and 143 (128 + the signal's number).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys

from mpiasgd.argtypes import command, positive
from mpiasgd.signals import Terminated

KINDS = ("auto", "imagefolder", "cifar10", "imagenet64")


def count(text: str) -> int:
    """An integer >= 0 (a number of images that may be none)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `data` and its actions to mpiasgd's subcommands."""
    data = command(sub, "data", "make dataset files (convert image folders, CIFAR-10, downsampled ImageNet; "
                                "synthetic sets) and print what one holds")
    actions = data.add_subparsers(dest="action", metavar="ACTION", required=True)
    cv = command(actions, "convert", "convert an image folder, CIFAR-10 or downsampled ImageNet into a dataset file")
    cv.add_argument("src", metavar="SRC", help="the source folder: train/<class>/*.jpg|png (and val/ or test/), "
                                               "a CIFAR-10 layout, or train_data_batch_1..10 + val_data")
    cv.add_argument("out", metavar="OUT.h5", help="the dataset file to write")
    cv.add_argument("--from", dest="kind", choices=KINDS, default="auto",
                    help="what SRC is (default auto: recognised by its files)")
    folder = cv.add_argument_group("image folders")
    folder.add_argument("--size", type=positive, default=None,
                        help="side of the stored square images in pixels (needed for an image folder, e.g. 64, 224)")
    folder.add_argument("--resize", choices=("crop", "squash"), default="crop",
                        help="crop (default): shorter side to SIZE, centre square; squash: whole image to SIZE x SIZE")
    folder.add_argument("--workers", type=positive, default=None,
                        help="decoding processes (default: the CPUs this process may use)")
    folder.add_argument("--name", default=None, help="the dataset's name (default: SRC's folder name)")
    _common(cv)
    sy = command(actions, "synth", "write an ImageNet-shaped synthetic dataset (class templates + noise) for "
                                   "throughput work")
    sy.add_argument("out", metavar="OUT.h5", help="the dataset file to write")
    sy.add_argument("--count", type=positive, required=True, help="train images")
    sy.add_argument("--size", type=positive, required=True, help="side of the square images in pixels")
    sy.add_argument("--classes", type=positive, default=1000, help="classes (default 1000)")
    sy.add_argument("--test-count", type=count, default=None, help="test images (default COUNT // 50, at least 1)")
    _common(sy)
    inf = command(actions, "info", "print what a dataset file holds: classes, splits, shapes, chunking, statistics")
    inf.add_argument("file", metavar="FILE", help="a dataset file written by mpiasgd data convert or synth")
    return data


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the train split's shuffle (synth: of every image; default 0)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    p.add_argument("--overwrite", action="store_true", help="replace OUT.h5 if it exists (default: refuse)")


def main(args: argparse.Namespace) -> int:
    """Run `mpiasgd data ACTION` for parsed args; returns the exit status (2: bad input, message on stderr;
    130: interrupted by SIGINT, 143: by SIGTERM, the partial output removed either way)."""
    from mpiasgd.data import convert

    def terminate(signum: int, frame: object) -> None:
        raise Terminated  # a KeyboardInterrupt: unwinds through the writer, which removes OUT.partial

    previous = signal.signal(signal.SIGTERM, terminate)  # scancel, a time limit: as Ctrl-C
    try:
        if args.action == "info":
            print(convert.info(args.file), flush=True)
            return 0
        if os.path.exists(args.out) and not args.overwrite:
            raise ValueError(f"{args.out} exists; pass --overwrite to replace it")
        if args.action == "synth":
            convert.synth(args.out, args.count, args.size, args.classes, args.test_count, args.seed, args.progress,
                          redo_command(args))
        else:
            _convert(args)
        print(convert.info(args.out), flush=True)
    except (OSError, ValueError) as e:  # DataError is a ValueError
        print(f"mpiasgd data {args.action}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        print(f"mpiasgd data {args.action}: interrupted ({signum.name}); no output file written", file=sys.stderr)
        return 128 + signum  # as a shell reports a process the signal ended
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _convert(args: argparse.Namespace) -> None:
    from mpiasgd.data import convert

    kind = convert.detect_source(args.src) if args.kind == "auto" else args.kind
    folder_only = [f"--{o}" for o in ("size", "workers", "name") if getattr(args, o) is not None]
    if args.resize != "crop":
        folder_only.append("--resize")
    if kind != "imagefolder" and folder_only:
        raise ValueError(f"{' '.join(folder_only)} apply to image folders only; {args.src} is {kind}")
    if kind == "imagefolder":
        if args.size is None:
            raise ValueError(f"{args.src} is an image folder: pass --size, the side of the stored images in "
                             "pixels (e.g. 64 or 224)")
        convert.convert_image_folder(args.src, args.out, args.size, args.resize, args.workers, args.seed,
                                     args.name, args.progress, redo_command(args))
    elif kind == "cifar10":
        convert.convert_cifar10(args.src, args.out, args.seed, redo_command(args))
    else:
        convert.convert_imagenet64(args.src, args.out, args.seed, args.progress, redo_command(args))


def redo_command(args: argparse.Namespace) -> str:
    """`mpiasgd data convert|synth` with `args`, paths absolute: what the file stores, so that a reader of the
    OUT.partial a killed conversion leaves can say how to redo it (`mpiasgd.data.h5data.redo_advice`)."""
    words = ["mpiasgd", "data", args.action]
    if args.action == "convert":
        words += [os.path.abspath(args.src), os.path.abspath(args.out)]
        words += ["--from", args.kind] if args.kind != "auto" else []
        words += [w for flag in ("size", "workers", "name") if getattr(args, flag) is not None
                  for w in (f"--{flag}", str(getattr(args, flag)))]
        words += ["--resize", args.resize] if args.resize != "crop" else []
    else:
        words += [os.path.abspath(args.out), "--count", str(args.count), "--size", str(args.size)]
        words += ["--classes", str(args.classes)] if args.classes != 1000 else []
        words += ["--test-count", str(args.test_count)] if args.test_count is not None else []
    words += ["--seed", str(args.seed)] if args.seed else []
    words += ["--overwrite"] if args.overwrite else []  # the file it was to replace is still there
    return shlex.join(words)
