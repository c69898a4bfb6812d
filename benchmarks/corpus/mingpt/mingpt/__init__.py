# Transcribed for barrierguard's agreement benchmark (benchmarks/bench_agreement.py)
# from https://github.com/karpathy/minGPT/blob/37baab71b9abea1b76ab957409a1cc2fbfba8a26/mingpt/__init__.py
# (MIT License, Copyright (c) 2020 Andrej Karpathy; full text in benchmarks/corpus/LICENSE.minGPT).
# Unchanged: the benchmark gives it small synthetic data through its own arguments.
