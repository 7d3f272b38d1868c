"""`python eval/report.py --help`: runs pp_lab.eval.report (its docstring says what it does)."""
from pp_lab.eval.report import main

if __name__ == "__main__":
    main()
