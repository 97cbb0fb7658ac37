"""Entry point of the ``adaattn`` command: the library's CLI over this folder's study registry."""

from adaattn.cli import build_app
from adaattn_experiments import STUDIES

app = build_app(STUDIES)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
