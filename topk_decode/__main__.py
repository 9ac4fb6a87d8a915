"""`python -m topk_decode ...` runs the `topk` command line."""

from topk_decode.cli.app import main

if __name__ == "__main__":
    main()
