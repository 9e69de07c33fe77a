"""Choosing an engine: the registry of built-in and plugin backends (``_registry``, through
pluggy), the decision guide as data (``_guide``), selection (``_select``), ``auto_engine`` and
``load_engine`` (``_auto``), and the engine builds ``unillm doctor`` reports (``_doctor``).
"""
