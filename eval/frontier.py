"""`python eval/frontier.py --help`: runs pp_lab.eval.frontier (its docstring says what it does)."""
from pp_lab.eval.frontier import main

if __name__ == "__main__":
    main()
