"""How much the demo PET's last node and edge features change when a structure is rotated.

    python scripts/demo_model/feature_invariance.py [CHECKPOINT] [tests/data/demo_model/test.xyz]

Why direct force heads cannot be added to the demo model with its backbone frozen
(docs/demo_model.md): a head sees only the last GNN layer's node features (per atom) and
edge features (per neighbor). A force head must turn them into a vector that rotates
with the structure; if they are (nearly) invariant under rotation, it cannot. Prints, per
family, the relative change ``|f(R x) - f(x)| / |f(x)|`` of both over five random
rotations of the first test structure of the family. Neighbors are matched by index, so
the edge figure is an upper bound (a rotation can reorder equidistant neighbors).
"""

import sys
import warnings

import numpy as np
import torch
from ase.io import read
from scipy.spatial.transform import Rotation


def main(checkpoint: str = "ase_tcfp32/data/pet-demo-chgnet.ckpt", structures: str = "tests/data/demo_model/test.xyz"):
    from metatomic_ase import MetatomicCalculator
    from metatrain.utils.io import load_model

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(checkpoint).eval()
    pet = getattr(model, "model", model)  # LLPR-wrapped or bare
    captured = {}
    pet.backend.gnn_layers[-1].register_forward_hook(lambda module, args, out: captured.update(out=out))
    calc = MetatomicCalculator(model.export(), device="cpu", uncertainty_threshold=None)

    def features(atoms):
        atoms.calc = calc
        atoms.get_potential_energy()
        nodes, edges = captured["out"][:2]
        return nodes.detach().numpy().copy(), edges.detach().numpy().copy()

    frames = read(structures, ":")
    rng = np.random.default_rng(0)
    for family in sorted({a.info["family"] for a in frames}):
        atoms = next(a for a in frames if a.info["family"] == family)
        nodes, edges = features(atoms.copy())
        node_change, edge_change = [], []
        for _ in range(5):
            rotation = Rotation.random(random_state=int(rng.integers(1 << 30))).as_matrix()
            rotated = atoms.copy()
            rotated.positions = rotated.positions @ rotation.T
            rotated.cell = rotated.cell.array @ rotation.T
            n, e = features(rotated)
            node_change.append(np.linalg.norm(n - nodes) / np.linalg.norm(nodes))
            if e.shape == edges.shape:
                edge_change.append(np.linalg.norm(e - edges) / np.linalg.norm(edges))
        print(
            f"{family:10s} node features {100 * np.mean(node_change):.2f}%  edge features "
            f"{100 * np.mean(edge_change):.2f}% (mean relative change over 5 rotations)"
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
