"""Small examples of each way your own data goes into fedrcl (docs/data.md), made from scikit-learn's bundled
8x8 digits, offline, in a second:

    python examples/data/make_examples.py data/examples

writes, under that folder:

- ``digits3.npz``: classes 0-2 as ``x_train``, ``y_train``, ``x_test``, ``y_test``, ``classes`` (uint8 [N, 8, 8, 1]);
- ``digits_folder/{train,test}/<class>/*.png``: an image folder (RGB PNGs);
- ``digits_domains/{plain,inverted}/<class>/*.png``: two domains, the second with inverted grey levels;
- ``digits_leaf/{train,test}/all_data_0.json``: LEAF's JSON, 12 "writers" with their own train and test images.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = np.round(d.images * 255.0 / 16.0).astype(np.uint8)
    y = d.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return x_tr, y_tr, x_te, y_te


def write_pngs(folder: Path, x: np.ndarray, y: np.ndarray, offset: int = 0) -> None:
    from PIL import Image

    for i, (image, label) in enumerate(zip(x, y)):
        (folder / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).convert("RGB").save(folder / str(label) / f"{offset + i:05d}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the examples in")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    x_tr, y_tr, x_te, y_te = digits()

    three_tr, three_te = y_tr < 3, y_te < 3
    np.savez(out / "digits3.npz", x_train=x_tr[three_tr, ..., None], y_train=y_tr[three_tr],
             x_test=x_te[three_te, ..., None], y_test=y_te[three_te], classes=np.array(["zero", "one", "two"]))

    write_pngs(out / "digits_folder" / "train", x_tr, y_tr)
    write_pngs(out / "digits_folder" / "test", x_te, y_te)

    x, y = np.concatenate([x_tr, x_te]), np.concatenate([y_tr, y_te])
    half = len(y) // 2
    write_pngs(out / "digits_domains" / "plain", x[:half], y[:half])
    write_pngs(out / "digits_domains" / "inverted", 255 - x[half:], y[half:], offset=half)

    rng = np.random.default_rng(0)
    writers = [f"w{i:02d}" for i in range(12)]
    for part, (xs, ys) in (("train", (x_tr, y_tr)), ("test", (x_te, y_te))):
        owner = rng.integers(0, len(writers), len(ys))  # each image's writer
        user_data = {w: {"x": (xs[owner == i].reshape(-1, 64) / 255.0).round(4).tolist(),
                         "y": ys[owner == i].tolist()} for i, w in enumerate(writers)}
        (out / "digits_leaf" / part).mkdir(parents=True, exist_ok=True)
        (out / "digits_leaf" / part / "all_data_0.json").write_text(json.dumps(
            {"users": writers, "num_samples": [len(user_data[w]["y"]) for w in writers], "user_data": user_data}))
    print(f"wrote digits3.npz, digits_folder, digits_domains, digits_leaf under {out}")


if __name__ == "__main__":
    main()
