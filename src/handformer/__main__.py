from handformer.cli import main

raise SystemExit(main())
