"""The planner: whether a model fits a machine at a context and concurrency, how it is placed
across devices (``_placement``), and the decode ceiling the memory bandwidth allows
(``_estimate``). Pure functions over the model's and the machine's facts; names no engine.
"""
