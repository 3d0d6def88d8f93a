"""The GPU check of issue #27: ``benchmarks/gpu_check.py`` runs the checks of this package."""
