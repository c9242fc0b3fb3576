"""Run the mmkv chat app: ``python app.py --model demo-llava --port 7860`` (see ``--help``)."""

import sys

from mmkv.ui.launch import main

if __name__ == "__main__":
    sys.exit(main())
