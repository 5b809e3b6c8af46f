"""``fedrcl plot`` (``fedrcl.plot``) with ``--band std``, the band the figures of docs/results.md were drawn with.

    python bench/plot_results.py FedAvg=runs/cifar10_a01_cnn_fedavg FedRCL=runs/cifar10_a01_cnn_fedrcl \
        --out docs/cnn.png --rounds 25 50 100 200

Kept so that the commands recorded beside those figures still run; new figures use ``fedrcl plot`` (95%
interval of the mean by default). Arguments are ``fedrcl plot``'s; a ``--band`` given here wins.
"""
import sys

from fedrcl.plot import main

if __name__ == "__main__":
    main(["--band", "std", *sys.argv[1:]])
