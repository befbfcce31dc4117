/**
 * The jupyter_shard JupyterLab extension: a "Distributed" side panel and a status-bar item for the
 * current notebook's rank pool (through the kernel's `jupyter_shard` comm), and the handler that
 * turns the strategy picker's "Insert as new cell" message into a cell below the active one.
 */
import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { KernelMessage } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { ShardClient } from './client';
import { insertCellCode, statusBarText } from './format';
import { DistributedPanel, POLL_MS } from './panel';

const ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">' +
  '<g class="jp-icon3" fill="#616161"><rect x="1" y="2" width="6" height="5" rx="1"/>' +
  '<rect x="9" y="2" width="6" height="5" rx="1"/><rect x="1" y="9" width="6" height="5" rx="1"/>' +
  '<rect x="9" y="9" width="6" height="5" rx="1"/></g></svg>';

const shardIcon = new LabIcon({ name: 'jupyter_shard:ranks', svgstr: ICON_SVG });

/** Insert `code` as a new code cell below the notebook's active cell. */
export function insertCell(panel: NotebookPanel, code: string): void {
  const notebook = panel.content;
  NotebookActions.insertBelow(notebook);
  const cell = notebook.activeCell;
  if (cell) {
    cell.model.sharedModel.setSource(code);
  }
}

function watchPicker(panel: NotebookPanel): void {
  panel.sessionContext.iopubMessage.connect((_, msg: KernelMessage.IMessage) => {
    if (msg.header.msg_type !== 'comm_msg') {
      return;
    }
    const code = insertCellCode((msg as KernelMessage.ICommMsgMsg).content.data);
    if (code !== null) {
      insertCell(panel, code);
    }
  });
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter_shard:plugin',
  description: 'Side panel and status bar for jupyter_shard rank pools',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILabShell, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    labShell: ILabShell | null,
    statusBar: IStatusBar | null
  ) => {
    const clients = new Map<NotebookPanel, ShardClient>();
    tracker.widgetAdded.connect((_, panel) => {
      const client = new ShardClient(panel.sessionContext);
      clients.set(panel, client);
      watchPicker(panel);
      // After a cell finishes, refresh once so the status bar follows without the panel open.
      panel.sessionContext.statusChanged.connect((_, status) => {
        if (status === 'idle' && Date.now() - lastRefresh.get(client)! > POLL_MS) {
          lastRefresh.set(client, Date.now());
          client.request('status');
        }
      });
      lastRefresh.set(client, 0);
      panel.disposed.connect(() => {
        clients.delete(panel);
        client.dispose();
      });
    });
    const lastRefresh = new Map<ShardClient, number>();

    const sidePanel = new DistributedPanel();
    sidePanel.title.icon = shardIcon;
    app.shell.add(sidePanel, 'right', { rank: 900 });

    const item = new Widget();
    item.addClass('jp-ShardStatus');
    let followed: ShardClient | null = null;
    const renderItem = () => {
      item.node.textContent = followed ? statusBarText(followed.status, followed.kernelBusy) : '';
      item.node.title = 'jupyter_shard rank pool: click for the Distributed panel';
    };
    item.node.onclick = () => app.shell.activateById(sidePanel.id);

    const follow = () => {
      const panel = tracker.currentWidget;
      const client = panel ? (clients.get(panel) ?? null) : null;
      followed?.changed.disconnect(renderItem);
      followed = client;
      client?.changed.connect(renderItem);
      sidePanel.client = client;
      renderItem();
    };
    tracker.currentChanged.connect(follow);
    follow();

    if (statusBar) {
      statusBar.registerStatusItem('jupyter_shard:status', {
        item,
        align: 'left',
        rank: 4,
        isActive: () => !!followed?.status?.pool
      });
    }
    void labShell;
  }
};

export default plugin;
