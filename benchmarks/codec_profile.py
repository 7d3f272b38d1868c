"""`python benchmarks/codec_profile.py --help`: runs pp_lab.bench.codec_profile (its docstring says what it does)."""
from pp_lab.bench.codec_profile import main

if __name__ == "__main__":
    main()
