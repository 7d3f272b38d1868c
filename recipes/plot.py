"""`python recipes/plot.py --help`: runs pp_lab.plot (its docstring says what it does)."""
from pp_lab.plot import main

if __name__ == "__main__":
    main()
