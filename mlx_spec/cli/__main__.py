from . import main

main(prog_name="mlx-spec")
