import sys

from infra.deploy import main

raise SystemExit(main(sys.argv[1:]))
