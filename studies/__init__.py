"""The studies behind docs/: drivers, recipes and tests that are not part of the installed package.

Run from a checkout: ``acre-train reproduce real|mini`` (acre_train/reproduce.py hands over to
``studies/reproduce.py``), or the scripts of ``studies/scorer`` and ``studies/training``.
"""
