"""`python recipes/convert.py --help`: runs pp_lab.convert (its docstring says what it does)."""
from pp_lab.convert import main

if __name__ == "__main__":
    main()
