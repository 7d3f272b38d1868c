"""`python eval/tasks.py --help`: runs pp_lab.eval.tasks (its docstring says what it does)."""
from pp_lab.eval.tasks import main

if __name__ == "__main__":
    main()
