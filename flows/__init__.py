"""The ``training`` and ``retraining`` flows, the ``relaytrain`` command and the pytest plugin.

Importing the package sets relaytrain's offline defaults (``flows.offline``): it is imported
before the first line of ``relaytrain`` and of ``python -m flows.training``, and before Prefect,
which reads its settings once, at its own first import.
"""

from flows import offline

offline.apply()
