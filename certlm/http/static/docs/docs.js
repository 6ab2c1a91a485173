// Starts Swagger UI on /docs. Plant networks have no internet: nothing here may make the browser reach another host.
"use strict";

const root = document.getElementById("swagger-ui");
window.ui = SwaggerUIBundle({
  url: root.dataset.openapiUrl,
  domNode: root,
  deepLinking: true,
  layout: "BaseLayout",
  presets: [SwaggerUIBundle.presets.apis],
  showExtensions: true,
  showCommonExtensions: true,
  // Swagger UI's default sends the description to an online validator for a badge.
  validatorUrl: null,
  // A ?url= or ?configUrl= in the address bar must not make the page load a description from elsewhere.
  queryConfigEnabled: false,
});
