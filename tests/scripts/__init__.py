"""Scripts from outside relaytrain, brought in each way the docs give (tests/integration/
test_brought_scripts.py), and what they need here that the machine lacks
(``torchvision_stand_in``)."""
