from meshwise.cli import main

raise SystemExit(main())
