"""`python recipes/data.py --help`: runs pp_lab.data (its docstring says what it does)."""
from pp_lab.data import main

if __name__ == "__main__":
    main()
