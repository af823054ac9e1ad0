"""Regenerate batchspec/v1/*_pb2*.py from protos/.

`--check` writes nothing and fails if the committed code is stale."""
import argparse
import filecmp
import pathlib
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_PACKAGE = ROOT / "batchspec" / "v1"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    protos = sorted(PROTO_DIR.glob("batchspec/v1/*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}"]
    if protoc.main(args + [str(p) for p in protos]) != 0:
        raise SystemExit("protoc failed")
    generated = sorted((out_root / "batchspec" / "v1").glob("*_pb2*.py*"))
    return generated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(pathlib.Path(tmp))
        stale = [g.name for g in generated if not (OUT_PACKAGE / g.name).exists()
                 or not filecmp.cmp(g, OUT_PACKAGE / g.name, shallow=False)]
        extra = {p.name for p in OUT_PACKAGE.glob("*_pb2*.py*")} - {g.name for g in generated}
        if args.check:
            if stale or extra:
                print(f"generated code is stale: {sorted(stale) + sorted(extra)}; "
                      "run python scripts/gen_protos.py", file=sys.stderr)
                return 1
            print("generated protobuf code is up to date")
            return 0
        OUT_PACKAGE.mkdir(parents=True, exist_ok=True)
        for g in generated:
            (OUT_PACKAGE / g.name).write_bytes(g.read_bytes())
        for name in extra:
            (OUT_PACKAGE / name).unlink()
    print(f"wrote {len(generated)} files to {OUT_PACKAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
