// The official JS SDK (e2b@2.51.0), installed once for every e2e suite in
// tests/e2e/js/node_modules (scripts/install-test-deps.sh): re-exported so the serve
// suite uses exactly that package without a second node_modules.
export * from '../../js/node_modules/e2b/dist/index.mjs'
