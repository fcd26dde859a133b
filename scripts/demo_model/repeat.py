"""Copy an extended XYZ data set with the structures of some families repeated.

    python scripts/demo_model/repeat.py train.xyz train-weighted.xyz cantor=4 other=4

metatrain weights every force component alike, so a family's share of the force loss is
its share of the atoms; repeating its structures is how the recipe raises it (the
``family`` key of each structure's info names its family, see make_dataset.py).
"""

import sys

from ase.io import read, write


def main(source: str, target: str, *repeats: str) -> None:
    times = {family: int(count) for family, count in (r.split("=") for r in repeats)}
    frames = read(source, ":")
    unknown = set(times) - {atoms.info["family"] for atoms in frames}
    if unknown:
        raise SystemExit(f"{source} has no structures of the families {sorted(unknown)}")
    write(target, [atoms for atoms in frames for _ in range(times.get(atoms.info["family"], 1))])


if __name__ == "__main__":
    main(*sys.argv[1:])
