"""Parts of ``benchmarks/gpu_report.py``: device correctness, kernel speed, end-to-end training."""
