"""`python eval/study.py --help`: runs pp_lab.eval.study (its docstring says what it does)."""
from pp_lab.eval.study import main

if __name__ == "__main__":
    main()
