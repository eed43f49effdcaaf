import os

# The RMT checks diagonalise many small (d ≤ 400) matrices, where threaded BLAS only adds synchronisation
# (and stalls badly on a loaded 2-core machine). Effective when numpy is not imported yet, e.g. `pytest tests/rmt`.
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
