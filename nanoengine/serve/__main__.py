import sys

from nanoengine.serve.cli import serve

sys.exit(serve())
