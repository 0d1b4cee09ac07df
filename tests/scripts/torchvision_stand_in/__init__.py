"""What an outside script imports from torchvision, for the machine that has neither
torchvision nor the internet: torchvision's wheels on PyPI are built against CUDA PyTorch and
do not load beside the CPU build relaytrain pins, and MNIST's files cannot be downloaded.

A brought-in script changes its ``from torchvision import ...`` lines to import from here, and
nothing else of its data code: ``datasets.FashionMNIST(root, train=..., download=...,
transform=...)`` is called as it was and returns a tiny map-style Dataset of 28x28 grey digit
images (what the repo ships, below), and ``transforms`` computes what torchvision's
``Compose``, ``ToTensor`` and ``Normalize`` compute.
"""
