"""`python recipes/torchtitan_cpu.py --module pp_compress.torchtitan --config llama3_debugmodel ...` on each rank:
runs pp_lab.torchtitan_cpu (torchtitan's own trainer on CPU processes with gloo; its docstring says what it patches)."""
from pp_lab.torchtitan_cpu import main

if __name__ == "__main__":
    main()
